"""interlens_mcore: multi-turn, multi-party colocated rollouts for GRPO training.

Names are imported on first use (PEP 562): `import interlens_mcore` costs no torch, megatron-core
or DeepSpeed import, so tool workers, plug-in loaders and the command line's `--help` start fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import exports

# module (relative to this package) -> the public names it holds
_EXPORTS: dict[str, tuple[str, ...]] = {
    ".chat": ("ChatFormat",),
    ".distributed": ("ParallelGroups", "build_groups"),
    ".engines.base": ("Engine", "Generation", "GenerationRequest", "SamplingParams"),
    ".engines.hf": ("HFEngine",),
    ".grpo.advantages": ("group_advantages",),
    ".grpo.batch": ("TrainingBatch", "build_batch"),
    ".grpo.loss.config": ("LossConfig",),
    ".grpo.loss.objective": ("grpo_loss",),
    ".rollout.conversation": ("Conversation", "Environment", "Participant", "Policy", "Scripted"),
    ".rollout.costep": ("co_step", "co_step_async", "schedule_signature"),
    ".rollout.mixin": ("RolloutMixin",),
    ".rollout.multiturn": (
        "EngineRollout",
        "MultiTurnError",
        "MultiTurnRequest",
        "MultiTurnScheduler",
        "MultiTurnValueError",
        "ResponseChoice",
        "RolloutOutput",
        "ToolScheduler",
        "prepare_requests",
        "run_multi_turn",
        "run_multi_turn_async",
    ),
    ".rollout.stop": ("AnyOf", "MaxTurns", "Predicate", "StopCondition", "TokenBudget", "stop_when"),
    ".rollout.vote": ("RolloutError", "RolloutValueError"),
    ".types": ("Message", "Status", "Trajectory", "TrajectoryInfo", "TurnSpan"),
}

if TYPE_CHECKING:  # what type checkers and editors see: the same names, imported eagerly
    from .chat import ChatFormat
    from .distributed import ParallelGroups, build_groups
    from .engines.base import Engine, Generation, GenerationRequest, SamplingParams
    from .engines.hf import HFEngine
    from .grpo.advantages import group_advantages
    from .grpo.batch import TrainingBatch, build_batch
    from .grpo.loss.config import LossConfig
    from .grpo.loss.objective import grpo_loss
    from .rollout.conversation import Conversation, Environment, Participant, Policy, Scripted
    from .rollout.costep import co_step, co_step_async, schedule_signature
    from .rollout.mixin import RolloutMixin
    from .rollout.multiturn import (
        EngineRollout,
        MultiTurnError,
        MultiTurnRequest,
        MultiTurnScheduler,
        MultiTurnValueError,
        ResponseChoice,
        RolloutOutput,
        ToolScheduler,
        prepare_requests,
        run_multi_turn,
        run_multi_turn_async,
    )
    from .rollout.stop import AnyOf, MaxTurns, Predicate, StopCondition, TokenBudget, stop_when
    from .rollout.vote import RolloutError, RolloutValueError
    from .types import Message, Status, Trajectory, TrajectoryInfo, TurnSpan


__getattr__, __dir__ = exports(__name__, _EXPORTS, globals())

__all__ = [
    "AnyOf",
    "ChatFormat",
    "Conversation",
    "Engine",
    "EngineRollout",
    "Environment",
    "Generation",
    "GenerationRequest",
    "HFEngine",
    "LossConfig",
    "MaxTurns",
    "Message",
    "MultiTurnError",
    "MultiTurnRequest",
    "MultiTurnScheduler",
    "MultiTurnValueError",
    "ParallelGroups",
    "Participant",
    "Policy",
    "Predicate",
    "ResponseChoice",
    "RolloutError",
    "RolloutMixin",
    "RolloutOutput",
    "RolloutValueError",
    "SamplingParams",
    "Scripted",
    "Status",
    "StopCondition",
    "TokenBudget",
    "ToolScheduler",
    "TrainingBatch",
    "Trajectory",
    "TrajectoryInfo",
    "TurnSpan",
    "build_batch",
    "build_groups",
    "co_step",
    "co_step_async",
    "group_advantages",
    "grpo_loss",
    "prepare_requests",
    "run_multi_turn",
    "run_multi_turn_async",
    "schedule_signature",
    "stop_when",
]
