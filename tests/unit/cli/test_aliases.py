"""TRL / ms-swift option names on the command line and in YAML (interlens_mcore/cli/aliases.py)."""

from __future__ import annotations

import pytest

from interlens_mcore.cli.args import UsageError, parse, parser


def test_trl_names_set_our_options():
    args = parse(
        [
            "--learning_rate", "2e-5",
            "--max-completion-length=12",
            "--per_device_train_batch_size", "8",
            "--num_iterations", "2",
            "--save_steps", "5",
            "--eval_steps", "7",
            "--max_steps", "30",
            "--max_grad_norm", "0.5",
            "--system", "Be brief.",
        ],
        "test",
    )  # fmt: skip
    t, r = args.trainer, args.rollout
    assert (t.lr, r.max_new_tokens, r.micro_batch_size, t.updates_per_rollout) == (2e-5, 12, 8, 2)
    assert (t.save_every, t.eval_every, t.steps, t.grad_clip) == (5, 7, 30, 0.5)
    assert args.launch.system_prompt == "Be brief."


def test_the_recipe_names_of_ms_swift_verl_and_trl_set_our_options():
    args = parse(
        ["--dynamic_sample", "--max_resample_times", "5", "--overlong_filter", "--tau_pos", "2.0",
         "--tau_neg", "0.5", "--entropy_coef", "0.01", "--adv_estimator", "rloo", "--use_kl_in_reward",
         "--kl_coef", "0.05", "--kl-ctrl", "adaptive", "--target_kl", "0.2"],
        "test",
    )  # fmt: skip
    t, r, loss = args.trainer, args.rollout, args.loss
    assert (t.dynamic_sampling, t.max_extra_rounds, r.mask_truncated_completions) == (True, 5, True)
    assert (loss.sapo_temperature_pos, loss.sapo_temperature_neg, loss.entropy_coeff) == (2.0, 0.5, 0.01)
    assert r.advantage_estimator == "rloo"
    assert (t.kl_in_reward, loss.beta, t.kl_ctrl, t.kl_target) == (True, 0.05, "adaptive", 0.2)


def test_names_we_share_with_trl_are_our_options():
    args = parse(
        ["--num_generations", "4", "--batch-size", "8", "--beta", "0.1", "--epsilon", "0.3",
         "--epsilon_high", "0.4", "--warmup_ratio", "0.1", "--lr_scheduler_type", "cosine",
         "--gradient_accumulation_steps", "2"],
        "test",
    )  # fmt: skip
    assert (args.rollout.num_generations, args.loss.beta, args.loss.epsilon, args.loss.epsilon_high) == (
        4, 0.1, 0.3, 0.4,
    )  # fmt: skip
    t = args.trainer
    assert (t.warmup_ratio, t.lr_scheduler_type, t.gradient_accumulation_steps) == (0.1, "cosine", 2)


def test_yaml_takes_trl_keys(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 3.0e-6\nmax_completion_length: 20\nnum_iterations: 2\n")
    args = parse(["--config", str(path)], "test")
    assert (args.trainer.lr, args.rollout.max_new_tokens, args.trainer.updates_per_rollout) == (3e-6, 20, 2)
    # the command line still wins over the YAML, under either name
    args = parse(["--config", str(path), "--lr", "1e-4", "--max-new-tokens", "9"], "test")
    assert (args.trainer.lr, args.rollout.max_new_tokens) == (1e-4, 9)


def test_an_option_and_its_alias_together_are_refused(tmp_path):
    with pytest.raises(UsageError, match=r"^--learning-rate and --lr both given"):
        parse(["--lr", "1e-3", "--learning_rate", "1e-4"], "test")
    path = tmp_path / "run.yaml"
    path.write_text("lr: 1.0e-3\nlearning_rate: 1.0e-4\n")
    with pytest.raises(UsageError, match=r"run.yaml: learning_rate and lr both given"):
        parse(["--config", str(path)], "test")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--max-prompt-length", "512"], r"^--max-prompt-length: prompts are never truncated here"),
        (["--logging_steps", "5"], r"^--logging-steps: every step is logged here"),
        (["--num-train-epochs", "1"], r"^--num-train-epochs: runs are counted in steps here: use --steps"),
    ],
)
def test_names_whose_meaning_differs_are_refused_with_ours(argv, says):
    with pytest.raises(UsageError, match=says):
        parse(argv, "test")


def test_a_refused_yaml_key_names_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("num_train_epochs: 3\n")
    with pytest.raises(UsageError, match=r"run.yaml: num_train_epochs: runs are counted in steps"):
        parse(["--config", str(path)], "test")


def test_typo_hints_know_the_aliases(tmp_path):
    hint = r"--max-completion-lenght \(did you mean --max-completion-length\?\)"
    with pytest.raises(UsageError, match=hint):
        parse(["--max-completion-lenght", "5"], "test")
    path = tmp_path / "run.yaml"
    path.write_text("learning_rat: 1.0e-4\n")
    with pytest.raises(UsageError, match=r"unknown key 'learning_rat' \(did you mean learning_rate\?\)"):
        parse(["--config", str(path)], "test")


def test_help_shows_the_aliases():
    p = parser("test")
    helps = {a.dest: a.help for a in p._actions}
    assert helps["lr"].endswith("(alias: --learning-rate)")
    assert helps["max_new_tokens"].endswith("(alias: --max-completion-length)")
    assert helps["updates_per_rollout"].endswith("(alias: --num-iterations)")
    assert helps["micro_batch_size"].endswith("(alias: --per-device-train-batch-size)")
    assert "(alias: --learning-rate)" in " ".join(p.format_help().split())
