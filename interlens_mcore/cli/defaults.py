"""Options a task brings: its defaults, under the user's YAML and command line.

Precedence, lowest first: the dataclass defaults, a named model's (`--model smollm2`: the sizes it
learns with on a CPU), the task's `TaskSource.option_defaults()` (and a dataset's
`--no-env-reward`), `--config FILE.yaml`, the command line. `apply` fills in the task's values
for the options the user did not set; `describe` is the line a launch script prints at start,
each value that is not a plain default with where it came from.
"""

from __future__ import annotations

import dataclasses

from interlens_mcore.cli.args import SECTIONS, Args, UsageError, flag

USER = ("run.json", "YAML", "command line")  # the origins `apply` never overrides

# what a policy that calls tools needs, whatever the task under it: room for a call in one reply
TOOL_DEFAULTS: dict[str, object] = {"max_new_tokens": 128}

# the origin of --no-env-reward on a dataset task, whose rows bring no reward of their own
DATASET_HAS_NO_REWARD = "a --dataset task, which has no reward of its own"


def model_defaults(model: str) -> dict[str, object]:
    """The options a named model learns with on a CPU when the user picks it (`--model smollm2`)."""
    from interlens_mcore.tasks.families import PRETRAINED_ON_CPU

    if model != "smollm2":
        return {}
    return {k: v for k, v in PRETRAINED_ON_CPU.items() if k != "model"}


def section_of(name: str) -> str:
    """The `Args` field (launch, backend, ...) whose dataclass has the option `name`."""
    for field_name, cls in zip(("launch", "backend", "trainer", "rollout", "loss"), SECTIONS, strict=True):
        if name in {f.name for f in dataclasses.fields(cls)}:
            return field_name
    raise KeyError(name)


def apply(args: Args, defaults: dict[str, object], origin: str) -> Args:
    """`args` with each of `defaults` the user did not set; its origin recorded as `origin`.

    A later `apply` overrides an earlier one's values (--tools over the task under them).

    A default that its section refuses (its __post_init__) is a bug of the task, named as such.
    """
    chosen = {k: v for k, v in defaults.items() if args.origins.get(k) not in USER}
    if not chosen:
        return args
    by_section: dict[str, dict[str, object]] = {}
    for name, value in chosen.items():
        try:
            by_section.setdefault(section_of(name), {})[name] = value
        except KeyError:
            raise ValueError(f"{origin}: option_defaults() names {name!r}, which is no option") from None
    changes = {}
    for section, values in by_section.items():
        try:
            changes[section] = dataclasses.replace(getattr(args, section), **values)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"{origin}: its default options do not hold ({exc})") from None
    origins = {**args.origins, **dict.fromkeys(chosen, origin)}
    return dataclasses.replace(args, **changes, origins=origins)


def describe(args: Args) -> str:
    """`options: --model smollm2 (task reasoning_gym), --steps 3 (command line); the rest default`."""
    parts = []
    for name, origin in args.origins.items():
        try:
            value = getattr(getattr(args, section_of(name)), name)
        except KeyError:  # an option of a script's own section
            continue
        parts.append(f"{flag(name)} {_show(value)} ({origin})")
    listed = "; ".join(parts) if parts else "none set"
    return f"options: {listed}; every other option at its default (--help lists them)"


def _show(value: object) -> str:
    if isinstance(value, list):
        return " ".join(str(v) for v in value) or "[]"
    return str(value)
