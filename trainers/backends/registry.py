"""The backends `--backend` may name: name -> the module whose `build` function makes it.

The one place a backend is registered: `BackendConfig.backend` accepts these names, the command
line offers them as `--backend` choices, and `factory.build_backend` imports the module of the
one it is given only then, so neither megatron-core nor DeepSpeed is needed to import this.
Every `build` has the signature of `base.BackendBuilder`.
"""

from __future__ import annotations

BACKENDS: dict[str, str] = {
    "megatron": "trainers.backends.megatron",
    "deepspeed": "trainers.backends.deepspeed",
}
