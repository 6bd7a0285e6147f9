"""ms-swift multi-turn schedulers and gym environments, run by the native driver.

A scheduler file written for ms-swift runs after changing only its import line::

    from interlens_mcore.compat.swift import MultiTurnScheduler

`run` rolls out rows with one, `rollout_trajectories` gives the trainer its trajectories,
`SwiftTaskSource` is the task source of the training path. docs/swift.md lists where these
semantics differ from the native `run_multi_turn` / `MultiTurnScheduler`.
"""

from .bridge import SwiftBridge
from .driver import build_requests, rollout_trajectories, run
from .gym import Env, GYMScheduler, GymScheduler, envs
from .plugins import build_scheduler, load_plugins, resolve_scheduler
from .scheduler import InferEngine, MultiTurnScheduler, multi_turns
from .tasks import SwiftTaskSource
from .transcript import HistoryRewriteError
from .types import (
    ChatCompletionResponseChoice,
    ChatMessage,
    RolloutInferRequest,
    RolloutOutput,
    SwiftOutput,
    TrainTurns,
)

__all__ = [
    "ChatCompletionResponseChoice",
    "ChatMessage",
    "Env",
    "GYMScheduler",
    "GymScheduler",
    "HistoryRewriteError",
    "InferEngine",
    "MultiTurnScheduler",
    "RolloutInferRequest",
    "RolloutOutput",
    "SwiftBridge",
    "SwiftOutput",
    "SwiftTaskSource",
    "TrainTurns",
    "build_requests",
    "build_scheduler",
    "envs",
    "load_plugins",
    "multi_turns",
    "resolve_scheduler",
    "rollout_trajectories",
    "run",
]
