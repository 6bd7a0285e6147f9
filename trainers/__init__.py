"""GRPO trainers users run or compose: the loop, its configs, and the Megatron-core / DeepSpeed backends.

The backends import megatron-core or DeepSpeed lazily, so importing this package needs neither.
"""

from .backend import Backend, build_backend
from .config import BackendConfig, TrainerConfig
from .grpo import GRPOTrainer


def __getattr__(name: str):
    if name == "MegatronBackend":
        from .megatron_backend import MegatronBackend

        return MegatronBackend
    if name in ("DeepSpeedBackend", "deepspeed_config"):
        from . import deepspeed_backend

        return getattr(deepspeed_backend, name)
    raise AttributeError(name)


__all__ = [
    "Backend",
    "BackendConfig",
    "DeepSpeedBackend",
    "GRPOTrainer",
    "MegatronBackend",
    "TrainerConfig",
    "build_backend",
    "deepspeed_config",
]
