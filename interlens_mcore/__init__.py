"""interlens_mcore: multi-turn, multi-party colocated rollouts for GRPO training."""

from .chat import ChatFormat
from .conversation import Conversation, Environment, Participant, Policy, Scripted
from .costep import co_step, schedule_signature
from .engine import Engine, Generation, GenerationRequest, HFEngine, SamplingParams
from .stop import AnyOf, MaxTurns, Predicate, StopCondition, TokenBudget, stop_when
from .trajectory import Message, Status, Trajectory, TurnSpan
from .vote import RolloutError

__all__ = [
    "AnyOf",
    "ChatFormat",
    "Conversation",
    "Engine",
    "Environment",
    "Generation",
    "GenerationRequest",
    "HFEngine",
    "MaxTurns",
    "Message",
    "Participant",
    "Policy",
    "Predicate",
    "RolloutError",
    "SamplingParams",
    "Scripted",
    "Status",
    "StopCondition",
    "TokenBudget",
    "Trajectory",
    "TurnSpan",
    "co_step",
    "schedule_signature",
    "stop_when",
]
