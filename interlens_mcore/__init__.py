"""interlens_mcore: multi-turn, multi-party colocated rollouts for GRPO training."""

from .advantages import group_advantages
from .batch import TrainingBatch, build_batch
from .chat import ChatFormat
from .conversation import Conversation, Environment, Participant, Policy, Scripted
from .costep import co_step, co_step_async, schedule_signature
from .engine import Engine, Generation, GenerationRequest, HFEngine, SamplingParams
from .loss import LossConfig, grpo_loss
from .mixin import RolloutMixin
from .multiturn import (
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
from .parallel import ParallelGroups, build_groups
from .stop import AnyOf, MaxTurns, Predicate, StopCondition, TokenBudget, stop_when
from .trajectory import Message, Status, Trajectory, TurnSpan
from .vote import RolloutError, RolloutValueError

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
