"""GRPO trainers users run or compose: the loop, its configs, and the Megatron-core / DeepSpeed backends.

The backends import megatron-core or DeepSpeed lazily, so importing this package needs neither.
"""

from .backends.base import Backend
from .backends.factory import build_backend
from .config import BackendConfig, TrainerConfig
from .grpo import GRPOTrainer


def __getattr__(name: str):
    if name == "MegatronBackend":
        from .backends.megatron import MegatronBackend

        return MegatronBackend
    if name in ("DeepSpeedBackend", "deepspeed_config"):
        from .backends import deepspeed

        return getattr(deepspeed, name)
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
