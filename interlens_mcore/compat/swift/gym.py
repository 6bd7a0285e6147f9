"""Gym environments in ms-swift's shape, and the scheduler that plays them.

An `Env` is built from its `env_config` (a row's `data_dict["env_config"]`), `reset(config)`
gets the request and returns `(observation, info)` or `(observation, info, system_message)`;
`step(action)` gets the messages so far and returns `(observation, reward, done, info)`;
`close()` releases it. Each may be `async`. Register an environment by name in `envs`::

    class Guess(Env):
        async def reset(self, config):
            self.secret = config.data_dict["secret"]
            return "Guess my number (1-9).", {}

        async def step(self, action):
            guess = action[-1]["content"].strip()
            won = guess == str(self.secret)
            return ("higher" if guess < str(self.secret) else "lower"), float(won), won, {}

        async def close(self):
            pass

    envs["guess"] = Guess
    scheduler = GymScheduler(max_turns=5, gym_env="guess")

`GymScheduler` resets one environment per request before the first turn (its first
observation becomes the user message, after the system message if there is one), steps it
with every reply, ends the request when the environment says `done`, and sends the next
observation as the next user message. `rollout_infos` carry `total_reward` (the episode's
sum, the reward key a gym task trains on), `step_rewards` and `gym_done`.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from ...rollout.limits import maybe_await
from .scheduler import InferEngine, MultiTurnScheduler, multi_turns
from .types import ChatCompletionResponseChoice, Message, RolloutInferRequest


class Env:
    """An environment a `GymScheduler` plays (see the module docstring)."""

    def __init__(self, env_config: dict[str, object]):
        self.env_config = env_config

    async def reset(self, config: RolloutInferRequest) -> tuple[Any, ...]:
        """(observation, info) or (observation, info, system_message)."""
        raise NotImplementedError(f"{type(self).__name__}: implement reset(config)")

    async def step(self, action: list[Message]) -> tuple[str, float, bool, dict[str, object]]:
        """(next observation, reward, done, info) after the policy's reply (`action[-1]`)."""
        raise NotImplementedError(f"{type(self).__name__}: implement step(action)")

    async def close(self) -> None:
        """Release the environment's resources."""


envs: dict[str, type[Env]] = {}
"""Environments by name: `GymScheduler(gym_env=NAME)` or a row's `env_config["name"]` picks one."""


def _reset_result(result: object, env: Env) -> tuple[str, str | None]:
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise ValueError(
            f"{type(env).__name__}.reset must return (observation, info) or "
            f"(observation, info, system_message), got {result!r}"
        )
    system = result[2] if len(result) == 3 else None
    return str(result[0]), system or None


def _step_result(result: object, env: Env) -> tuple[str, float, object, dict[str, object]]:
    if not isinstance(result, tuple) or len(result) != 4:
        raise ValueError(
            f"{type(env).__name__}.step must return (observation, reward, done, info), got {result!r}"
        )
    observation, reward, done, info = result
    return observation, float(reward), done, info


class GymScheduler(MultiTurnScheduler):
    """Plays one `Env` per request (see the module docstring)."""

    def __init__(self, infer_engine: InferEngine | None = None, max_turns: int | None = None, **kwargs):
        super().__init__(infer_engine, max_turns, **kwargs)
        self.gym_env_name = kwargs.get("gym_env")
        self._envs: dict[str, Env] = {}
        self._total: dict[str, float] = {}
        self._steps: dict[str, list[float]] = {}
        self._pending: dict[str, str | None] = {}  # the observation the next step sends

    def create_env(self, env_config: dict[str, object]) -> Env:
        name = env_config.get("name", self.gym_env_name)
        if name not in envs:
            raise ValueError(f"gym environment {name!r} is not registered; registered: {sorted(envs)}")
        return envs[name](env_config)

    async def _close(self, uuid: str) -> None:
        env = self._envs.pop(uuid, None)
        for table in (self._total, self._steps, self._pending):
            table.pop(uuid, None)
        if env is not None:
            await maybe_await(env.close())

    async def _reset(self, request: RolloutInferRequest) -> None:
        if request.uuid in self._envs:
            await self._close(request.uuid)
        env = self.create_env(dict((request.data_dict or {}).get("env_config") or {}))
        observation, system = _reset_result(await maybe_await(env.reset(request)), env)
        system_messages = [{"role": "system", "content": system}] if system else []
        request.messages = [*system_messages, {"role": "user", "content": observation}]
        self._envs[request.uuid], self._total[request.uuid] = env, 0.0
        self._steps[request.uuid], self._pending[request.uuid] = [], None

    async def on_trajectory_start(self, requests: list[RolloutInferRequest]) -> None:
        await asyncio.gather(*(self._reset(r) for r in requests))

    async def on_turn_end(
        self,
        infer_request: RolloutInferRequest,
        response_choice: ChatCompletionResponseChoice,
        current_turn: int,
    ) -> dict[str, Any]:
        uuid = infer_request.uuid
        env = self._envs.get(uuid)
        if env is None:  # its episode already ended
            return {"done": True}
        result = await maybe_await(env.step(copy.deepcopy(infer_request.messages)))
        observation, reward, done, _ = _step_result(result, env)
        self._total[uuid] += reward
        self._steps[uuid].append(reward)
        self._pending[uuid] = None if done else observation
        infos = {
            "total_reward": self._total[uuid],
            "step_rewards": list(self._steps[uuid]),
            "gym_done": bool(done),
        }
        if done:
            await self._close(uuid)
        return {"done": done, "rollout_infos": infos}

    def step(
        self,
        infer_request: RolloutInferRequest,
        response_choice: ChatCompletionResponseChoice,
        current_turn: int,
    ) -> dict[str, Any]:
        observation = self._pending.get(infer_request.uuid)
        if observation is not None:
            infer_request.messages.append({"role": "user", "content": str(observation)})
            self._pending[infer_request.uuid] = None
        return {"infer_request": infer_request}

    async def on_trajectory_end(
        self, requests: list[RolloutInferRequest], error: BaseException | None = None
    ) -> None:
        await asyncio.gather(*(self._close(r.uuid) for r in requests))


GYMScheduler = GymScheduler  # ms-swift's spelling
multi_turns["gym_scheduler"] = GymScheduler  # ms-swift's registry name (a plugin file's own wins)
