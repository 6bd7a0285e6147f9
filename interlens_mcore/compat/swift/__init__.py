"""ms-swift multi-turn schedulers and gym environments, run by the native driver.

A scheduler file written for ms-swift runs after changing only its import line::

    from interlens_mcore.compat.swift import MultiTurnScheduler

Every name ms-swift's own `multi_turn.py` and `gym_env.py` import is here (`RequestConfig`,
`ChatCompletionResponse`, `Messages`, `remove_response`, `get_logger`, `MathAccuracy`, ...);
classes written on ms-swift's own base classes run too, by their hooks (foreign.py).

`run` rolls out rows with one, `rollout_trajectories` gives the trainer its trajectories,
`SwiftTaskSource` is the task source of the training path. docs/swift.md lists where these
semantics differ from the native `run_multi_turn` / `MultiTurnScheduler`.
"""

from .bridge import SwiftBridge
from .driver import build_requests, rollout_trajectories, run
from .foreign import SwiftStyle, is_swift_style
from .gym import Env, GYMScheduler, GymScheduler, envs
from .orm import ORM, AsyncORM, MathAccuracy, orms
from .plugins import build_scheduler, load_plugins, resolve_gym_env, resolve_scheduler
from .scheduler import InferEngine, MultiTurnScheduler, multi_turns
from .tasks import SwiftTaskSource
from .transcript import HistoryRewriteError
from .types import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    Messages,
    RequestConfig,
    RolloutInferRequest,
    RolloutOutput,
    SwiftOutput,
    TrainTurns,
)
from .utils import get_logger, get_token_backed_response_ids, remove_response

__all__ = [
    "ChatCompletionResponse",
    "ChatCompletionResponseChoice",
    "ChatMessage",
    "Env",
    "GYMScheduler",
    "GymScheduler",
    "HistoryRewriteError",
    "InferEngine",
    "MathAccuracy",
    "ORM",
    "AsyncORM",
    "orms",
    "Messages",
    "MultiTurnScheduler",
    "RequestConfig",
    "RolloutInferRequest",
    "RolloutOutput",
    "SwiftBridge",
    "SwiftOutput",
    "SwiftStyle",
    "SwiftTaskSource",
    "TrainTurns",
    "build_requests",
    "build_scheduler",
    "envs",
    "get_logger",
    "get_token_backed_response_ids",
    "is_swift_style",
    "load_plugins",
    "multi_turns",
    "remove_response",
    "resolve_gym_env",
    "resolve_scheduler",
    "rollout_trajectories",
    "run",
]
