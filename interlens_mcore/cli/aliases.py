"""The option names TRL and ms-swift users type, as aliases of ours (command line and YAML keys).

`ALIASES` maps a name to our option of the same meaning; `REFUSED` names the ones whose
meaning differs from anything here, each with what to use instead (a wrong mapping would be
worse than a clear refusal). Names that are ours already (`num_generations`, `beta`,
`epsilon`, `epsilon_high`, `warmup_ratio`, `lr_scheduler_type`, `gradient_accumulation_steps`,
`temperature`, `seed`, `save_total_limit`, `report_to`, ...) need no entry. README.md has the table.
"""

from __future__ import annotations

from collections.abc import Iterable

ALIASES: dict[str, str] = {
    "learning_rate": "lr",
    "per_device_train_batch_size": "micro_batch_size",  # trajectories per forward/backward on a rank
    "num_iterations": "updates_per_rollout",
    "max_completion_length": "max_new_tokens",  # a cap per policy turn (one turn: the completion)
    "max_steps": "steps",
    "max_grad_norm": "grad_clip",
    "save_steps": "save_every",
    "eval_steps": "eval_every",
    "system": "system_prompt",  # ms-swift's --system
    "tau_pos": "sapo_temperature_pos",  # ms-swift's (and verl's actor.tau_pos) for SAPO
    "tau_neg": "sapo_temperature_neg",
    "entropy_coef": "entropy_coeff",  # TRL's spelling of verl's name
    "overlong_filter": "mask_truncated_completions",  # ms-swift's name of TRL's option
    "dynamic_sample": "dynamic_sampling",  # ms-swift's; verl's algorithm.filter_groups.enable
    "max_resample_times": "max_extra_rounds",  # ms-swift's; verl's filter_groups.max_num_gen_batches - 1
    "adv_estimator": "advantage_estimator",  # verl's algorithm.adv_estimator (ms-swift's is ours)
    "use_kl_in_reward": "kl_in_reward",  # verl's algorithm.use_kl_in_reward (ms-swift's is ours)
    "kl_coef": "beta",  # verl's algorithm.kl_ctrl.kl_coef: one coefficient here, in the loss or the reward
    "target_kl": "kl_target",  # verl's algorithm.kl_ctrl.target_kl
    "gradient_checkpointing": "recompute",  # TRL's (transformers' TrainingArguments)
    "lora_r": "lora_rank",  # TRL's ModelConfig (peft's LoraConfig.r); ms-swift and verl say lora_rank
}

REFUSED: dict[str, str] = {
    "max_prompt_length": "prompts are never truncated here (a turn's cap is --max-new-tokens); "
    "shorten the dataset's prompts instead",
    "logging_steps": "every step is logged here (metrics.jsonl); sample completions every "
    "--log-completions-every steps",
    "num_train_epochs": "runs are counted in steps here: use --steps N (each step draws "
    "--batch-size / --num-generations prompts per rank)",
}


class AliasError(ValueError):
    """An alias given with its own option, or a refused name (cli/args.py makes it a UsageError)."""


def dashed(name: str) -> str:
    return "--" + name.replace("_", "-")


def alias_flags() -> list[str]:
    """Every alias and refused name as a flag, for typo hints."""
    return [dashed(n) for n in (*ALIASES, *REFUSED)]


def aliases_of(option: str) -> list[str]:
    return [a for a, target in ALIASES.items() if target == option]


def rename_argv(argv: list[str]) -> list[str]:
    """`--learning-rate 1e-5` -> `--lr 1e-5` (also `--learning_rate=1e-5`); AliasError on a refused
    name or an alias given with its option."""
    given = {_name(a) for a in argv if a.startswith("--")}
    out = []
    for a in argv:
        name = _name(a) if a.startswith("--") else None
        if name in REFUSED:
            raise AliasError(f"{dashed(name)}: {REFUSED[name]}")
        if name in ALIASES:
            target = ALIASES[name]
            if target in given:
                raise AliasError(
                    f"{dashed(name)} and {dashed(target)} both given: one option, two names (keep one)"
                )
            a = dashed(target) + a[len(a.split("=", 1)[0]) :]
        out.append(a)
    return out


def rename_keys(keys: Iterable[str], where: str) -> dict[str, str]:
    """YAML key -> our option name, for keys written with `_` or `-`; AliasError as `rename_argv`."""
    names = {str(k): str(k).replace("-", "_") for k in keys}
    out = {}
    for key, name in names.items():
        if name in REFUSED:
            raise AliasError(f"{where}: {key}: {REFUSED[name]}")
        target = ALIASES.get(name, name)
        if target != name and target in names.values():
            raise AliasError(f"{where}: {key} and {target} both given: one option, two names (keep one)")
        out[key] = target
    return out


def _name(arg: str) -> str:
    return arg[2:].split("=", 1)[0].replace("-", "_")
