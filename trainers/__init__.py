"""GRPO trainers users run or subclass: the shared loop and the Megatron-core / DeepSpeed backends.

The backends import megatron-core or DeepSpeed lazily, so importing this package needs neither.
"""

from .base import GRPOTrainer, TrainerConfig


def __getattr__(name: str):
    if name == "MegatronGRPOTrainer":
        from .megatron_trainer import MegatronGRPOTrainer

        return MegatronGRPOTrainer
    if name in ("DeepSpeedGRPOTrainer", "deepspeed_config"):
        from . import deepspeed_trainer

        return getattr(deepspeed_trainer, name)
    raise AttributeError(name)


__all__ = ["DeepSpeedGRPOTrainer", "GRPOTrainer", "MegatronGRPOTrainer", "TrainerConfig", "deepspeed_config"]
