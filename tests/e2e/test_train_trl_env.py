"""TRL environment classes trained through launch/train_grpo.py --environment-factory, as written
for TRL (support/trl_envs.py: stateful games with two tool methods and get_reward), and TRL's own
GRPOTrainer on the same classes, in this process, rendering the same prompts.

The launch is what is under test (the flag, the rows reaching reset, the rewards on 2 gloo
ranks), so each case is one torchrun launch of 3 small steps (about 20 s here); TRL's run is 3
steps on CPU in this process (about 10 s).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from support.launch import ROOT, metrics, torchrun

ENVS = ROOT / "tests" / "support" / "trl_envs.py"
ASSISTANT = "<|im_start|>assistant\n"
SMALL = ["--steps", "3", "--batch-size", "4", "--num-generations", "4", "--max-new-tokens", "16"]
SMALL += ["--eval-every", "0", "--log-completions-every", "1", "--log-completions", "4"]


def write_rows(path: Path, *, mixed: bool) -> Path:
    rows = []
    for i in range(10):
        env = "lamp" if mixed and i % 2 == 0 else "vault"
        text = "Switch on the lamp." if env == "lamp" else "Open the vault."
        row = {"prompt": [{"role": "user", "content": text}], "code": i}
        rows.append({**row, "environment": env} if mixed else row)
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def our_prompts(out: Path) -> set[str]:
    """The opening of every logged sample: its text up to the policy's first turn."""
    texts = [json.loads(line)["text"] for line in (out / "completions.jsonl").read_text().splitlines()]
    return {t[: t.index(ASSISTANT) + len(ASSISTANT)] for t in texts}


def trl_prompts(rows: Path, factory, reward_funcs) -> set[str]:
    """The prompts TRL's GRPOTrainer renders for `factory` over `rows` in 3 steps (CPU, in process)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from interlens_mcore.assets import ensure_default_policy
    from interlens_mcore.assets.chat_templates import with_tool_template

    folder = ensure_default_policy()  # the launch's default --model
    seen: list[str] = []

    class Recorded(GRPOTrainer):  # reads what TRL generated from, changes nothing
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            for ids, mask in zip(out["prompt_ids"], out["prompt_mask"], strict=True):
                seen.append(self.processing_class.decode(ids[mask.bool()]))
            return out

    data = [json.loads(line) for line in rows.read_text().splitlines()]
    args = GRPOConfig(
        output_dir=str(rows.parent / "trl"), use_cpu=True, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=16, max_steps=3, report_to="none", save_strategy="no", bf16=False, seed=0,
    )  # fmt: skip
    trainer = Recorded(
        model=AutoModelForCausalLM.from_pretrained(folder),
        processing_class=with_tool_template(AutoTokenizer.from_pretrained(folder)),
        args=args,
        train_dataset=Dataset.from_list(data),
        environment_factory=factory,
        reward_funcs=reward_funcs,
    )
    trainer.train()
    assert trainer.state.global_step == 3
    return set(seen)


def test_a_trl_environment_class_trains_as_under_trl(tmp_path):
    from support.trl_envs import Vault, fewer_tries

    rows, out = write_rows(tmp_path / "vault.jsonl", mixed=False), tmp_path / "run"
    res = torchrun(
        "--environment-factory", f"{ENVS}:Vault", "--dataset", str(rows),
        "--reward", f"{ENVS}:fewer_tries", "--output-dir", str(out), *SMALL, timeout=240,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    steps = metrics(out)
    assert [r["step"] for r in steps] == [0, 1, 2]
    # get_reward under the class's name, beside the reward function reading environments=
    assert all(0.0 <= r["reward/Vault"] <= 1.0 and r["reward/fewer_tries"] <= 0.0 for r in steps)
    run = json.loads((out / "run.json").read_text())
    assert run["rewards"] == ["fewer_tries", "Vault"]
    ours = our_prompts(out)
    # one prompt: the user's message with reset's text, after the tools' schemas
    [prompt] = ours
    assert "<|im_start|>user\nOpen the vault. The code is one digit.<|im_end|>\n" in prompt
    assert '"name": "try_code"' in prompt and '"name": "hint"' in prompt
    assert trl_prompts(rows, Vault, [fewer_tries]) == ours


def test_a_dict_of_environments_picks_by_the_rows_column(tmp_path):
    from support.trl_envs import BY_NAME

    rows, out = write_rows(tmp_path / "mixed.jsonl", mixed=True), tmp_path / "run"
    res = torchrun(
        "--environment-factory", f"{ENVS}:BY_NAME", "--dataset", str(rows), "--output-dir", str(out),
        "--log-completions", "8", *SMALL, timeout=240,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    steps = metrics(out)
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert all({"reward/Vault", "reward/Lamp"} <= set(r) for r in steps)
    ours = our_prompts(out)
    # 6 of the 9 training rows (5 lamps, 4 vaults) drawn without repeats: both environments
    lamp = [p for p in ours if "Switch on the lamp." in p]
    vault = [p for p in ours if "Open the vault. The code is one digit." in p]
    assert len(lamp) == 1 and len(vault) == 1 and len(ours) == 2
    assert '"name": "switch"' in lamp[0] and '"name": "try_code"' not in lamp[0]
    assert '"name": "try_code"' in vault[0] and '"name": "switch"' not in vault[0]
    assert trl_prompts(rows, BY_NAME, []) == ours
