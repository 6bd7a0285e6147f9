"""gymnasium toy-text environments as text games: FrozenLake, Taxi, CliffWalking, Blackjack.

`source("FrozenLake-v1", is_slippery=False)`: keyword arguments other than the options below go
to `gymnasium.make`. Each row is an episode started from its own seed (`env.reset(seed=...)`);
seeds are held out for evaluation by a hash (`eval_fraction`), so training and evaluation never
share a seed. (A deterministic environment on a fixed map starts every episode alike whatever
the seed; `random_map=True` gives FrozenLake a map drawn from the seed.)

Observations are rendered as plain text by this module (the environments' ANSI rendering
carries colour codes): a grid with `@` for the player, or for Blackjack the sums.

Action grammar: the reply's action is the text inside its last `<action>...</action>`, else
the last action name appearing in the reply as a whole word; names are case-insensitive
(FrozenLake: left, down, right, up; CliffWalking: up, right, down, left; Taxi: south, north,
east, west, pickup, dropoff; Blackjack: stick, hit). A reply with no valid action is answered
with the reason and the current observation, is counted, and costs a step.

Reward: the episode's return (the sum of the environment's rewards) plus `invalid_penalty`
per invalid reply. `conv.infos`: `return`, `steps`, `invalid_actions`, `success` (1.0 when the
goal was reached: FrozenLake's goal, CliffWalking's goal, Taxi's delivery, a Blackjack win).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..rollout.conversation import Conversation, Environment, Participant, Policy
from ..types import Message
from .base import TaskSource
from .families import LONG_CONVERSATIONS
from .split import check_fraction, derive_seed, held_out


def parse_action(text: str, names: tuple[str, ...], tag: str = "action") -> int | None:
    """The index in `names` of the reply's action (see the module docstring), or None."""
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL | re.IGNORECASE)
    lowered = [n.lower() for n in names]
    if found:
        word = found[-1].strip().lower()
        return lowered.index(word) if word in lowered else None
    pattern = r"\b(" + "|".join(re.escape(n) for n in lowered) + r")\b"
    words = re.findall(pattern, text.lower())
    return lowered.index(words[-1]) if words else None


def _grid(rows: list[list[str]], at: tuple[int, int] | None) -> str:
    cells = [list(r) for r in rows]
    if at is not None:
        cells[at[0]][at[1]] = "@"
    return "\n".join(" ".join(r) for r in cells)


def _frozen_lake(env: Any, obs: int) -> str:
    desc = env.unwrapped.desc.astype(str).tolist()
    r, c = divmod(int(obs), len(desc[0]))
    return f"{_grid(desc, (r, c))}\nYou are at row {r}, column {c}."


def _cliff(env: Any, obs: int) -> str:
    nrow, ncol = env.unwrapped.shape
    rows = [["."] * ncol for _ in range(nrow)]
    rows[-1] = ["S"] + ["C"] * (ncol - 2) + ["G"]
    r, c = divmod(int(obs), ncol)
    return f"{_grid(rows, (r, c))}\nYou are at row {r}, column {c}."


_TAXI_STOPS = "RGYB"


def _taxi(env: Any, obs: int) -> str:
    row, col, passenger, dest = env.unwrapped.decode(int(obs))
    desc = env.unwrapped.desc.astype(str).tolist()
    lines = ["".join(r) for r in desc]
    taxi_line = list(lines[row + 1])
    taxi_line[2 * col + 1] = "@"
    lines[row + 1] = "".join(taxi_line)
    where = "in the taxi" if passenger == 4 else f"waiting at {_TAXI_STOPS[passenger]}"
    return (
        "\n".join(lines)
        + f"\nThe taxi (@) is at row {row}, column {col}. The passenger is {where}; "
        + f"the destination is {_TAXI_STOPS[dest]}."
    )


def _blackjack(env: Any, obs: tuple) -> str:
    total, dealer, ace = (int(x) for x in obs)
    return f"Your cards sum to {total}{' (with a usable ace)' if ace else ''}. The dealer shows {dealer}."


@dataclass(frozen=True)
class GymGame:
    """What this module knows of one environment family."""

    actions: tuple[str, ...]
    render: Callable[..., str]  # (the gymnasium env, its observation) -> text
    rules: str
    max_steps: int  # replies per episode, invalid ones included
    success: Callable[[float, bool], bool]  # (last reward, terminated) -> goal reached


GAMES: dict[str, GymGame] = {
    "FrozenLake": GymGame(
        actions=("left", "down", "right", "up"),
        render=_frozen_lake,
        rules="Walk from S to the goal G over frozen tiles F without falling into a hole H. "
        "The ice may be slippery.",
        max_steps=16,
        success=lambda r, term: term and r > 0,
    ),
    "CliffWalking": GymGame(
        actions=("up", "right", "down", "left"),
        render=_cliff,
        rules="Walk from S to G. Stepping on the cliff C costs 100 and sends you back to S; "
        "every step costs 1.",
        max_steps=24,
        success=lambda r, term: term,
    ),
    "Taxi": GymGame(
        actions=("south", "north", "east", "west", "pickup", "dropoff"),
        render=_taxi,
        rules="Drive the taxi to the passenger, pick them up, drive to the destination and drop "
        "them off. | is a wall, : is open road. Delivering earns 20, a wrong pickup or dropoff "
        "costs 10, every step costs 1.",
        max_steps=24,
        success=lambda r, term: term and r > 0,
    ),
    "Blackjack": GymGame(
        actions=("stick", "hit"),
        render=_blackjack,
        rules="Get a hand closer to 21 than the dealer without going over. Hit draws a card; "
        "stick ends your turn. A win scores 1, a loss -1.",
        max_steps=8,
        success=lambda r, term: term and r > 0,
    ),
}


def game_of(env_id: str) -> GymGame:
    family = re.match(r"[A-Za-z]+", env_id.rpartition("/")[2])
    name = family.group() if family else ""
    for key, game in GAMES.items():
        if name.startswith(key):
            return game
    raise ValueError(
        f"gym: no text rendering for {env_id!r}; supported: {', '.join(sorted(GAMES))} (toy text)"
    )


@dataclass(frozen=True, kw_only=True)
class GymOptions:
    max_steps: int | None = None  # None: the game's default
    invalid_penalty: float = 0.0  # added to the return per invalid reply (e.g. -0.1)
    action_tag: str = "action"
    random_map: bool = False  # FrozenLake only: a map drawn from the episode's seed
    map_size: int = 4
    make_args: dict[str, object] = field(default_factory=dict)


@dataclass(eq=False)
class GymTask:
    """One episode: the environment id, its seed, the options."""

    env_id: str
    seed: int
    options: GymOptions

    @property
    def game(self) -> GymGame:
        return game_of(self.env_id)

    @property
    def max_steps(self) -> int:
        return self.options.max_steps or self.game.max_steps

    @property
    def max_turns(self) -> int:
        return 2 * self.max_steps

    @property
    def columns(self) -> dict[str, object]:
        return {"env_id": self.env_id, "seed": self.seed}

    def make(self) -> tuple[Any, Any]:
        """A fresh environment, reset to this episode's first observation."""
        import gymnasium

        args: dict[str, Any] = dict(self.options.make_args)  # gymnasium.make's keywords
        if self.options.random_map:
            from gymnasium.envs.toy_text.frozen_lake import generate_random_map

            args["desc"] = generate_random_map(size=self.options.map_size, seed=self.seed)
        env = gymnasium.make(self.env_id, **args)
        obs, _ = env.reset(seed=self.seed)
        return env, obs

    def prompt(self) -> list[Message]:
        env, obs = self.make()
        game, tag = self.game, self.options.action_tag
        text = (
            f"{game.rules}\nActions: {', '.join(game.actions)}. Reply with one action as "
            f"<{tag}>NAME</{tag}>.\n{game.render(env, obs)}"
        )
        env.close()
        return [Message(speaker="user", content=text, role="user")]

    def lineup(self, seat: Callable[[str], Policy]) -> list[Participant]:
        return [seat("policy"), GymEnvironment(self)]


class GymEnvironment(Environment):
    """Steps one episode with the actions parsed from the policy's replies."""

    name, role = "env", "user"

    def __init__(self, task: GymTask, *, policy: str = "policy"):
        self.task, self.policy = task, policy
        self.env, self.obs = task.make()
        self.total, self.steps, self.invalid = 0.0, 0, 0

    def respond(self, conv: Conversation) -> str | None:
        game, opts = self.task.game, self.task.options
        reply = next((m.content for m in reversed(conv.messages) if m.speaker == self.policy), "")
        action = parse_action(reply, game.actions, opts.action_tag)
        self.steps += 1
        if action is None:
            self.invalid += 1
            self.total += opts.invalid_penalty
            text = (
                f"Invalid action: reply with one of {', '.join(game.actions)} as "
                f"<{opts.action_tag}>NAME</{opts.action_tag}>.\n{game.render(self.env, self.obs)}"
            )
            done, reached = False, False
        else:
            self.obs, reward, terminated, truncated, _ = self.env.step(action)
            self.total += float(reward)
            reached = game.success(float(reward), bool(terminated))
            done = bool(terminated or truncated)
            text = game.render(self.env, self.obs)
        conv.infos.update(
            {
                "return": self.total,
                "steps": self.steps,
                "invalid_actions": self.invalid,
                "success": float(reached),
            }
        )
        if done or self.steps >= self.task.max_steps:
            conv.request_stop("goal" if reached else "episode over" if done else "out of steps")
            self.env.close()
            return None
        return text

    def reward(self, conv: Conversation) -> float:
        return self.total


def plan(env: Any, gamma: float = 0.99, tol: float = 1e-6) -> list[int]:
    """The best action in each state of a toy-text environment with a transition table
    (`env.unwrapped.P`: FrozenLake, Taxi, CliffWalking), by value iteration on expected returns.

    With a discount below 1 the best action of a deterministic game is the first move of a
    shortest path to the best outcome (the goal, a delivery), which is what a breadth-first
    search finds; on slippery ice it is the move most likely to get there.
    """
    import numpy as np

    table = getattr(env.unwrapped, "P", None)
    if not isinstance(table, dict):
        raise NotImplementedError(
            f"gym: {env.spec.id if env.spec else env} has no transition table to plan on"
        )
    states, actions = len(table), len(table[0])
    width = max(len(table[s][a]) for s in range(states) for a in range(actions))
    prob = np.zeros((states, actions, width))
    after = np.zeros((states, actions, width), dtype=np.int64)
    gain = np.zeros((states, actions, width))
    going = np.zeros((states, actions, width))  # 1 where the outcome does not end the episode
    for s in range(states):
        for a in range(actions):
            for k, (p, s2, r, done) in enumerate(table[s][a]):
                prob[s, a, k], after[s, a, k], gain[s, a, k], going[s, a, k] = p, int(s2), r, not done
    value = np.zeros(states)
    for _ in range(100_000):
        q = (prob * (gain + gamma * going * value[after])).sum(axis=2)
        best = q.max(axis=1)
        if np.abs(best - value).max() < tol:
            break
        value = best
    return [int(a) for a in q.argmax(axis=1)]


def demonstration(task: GymTask, policy: list[int]) -> list[dict[str, str]] | None:
    """One episode played by `policy` (state -> action) in the task's move format, as OpenAI
    messages: the prompt, then each move and the environment's answer; None if it missed the goal."""
    game, tag = task.game, task.options.action_tag
    env, obs = task.make()
    messages = [{"role": m.role, "content": m.content} for m in task.prompt()]
    try:
        for _ in range(task.max_steps):
            action = policy[int(obs)]
            messages.append({"role": "assistant", "content": f"<{tag}>{game.actions[action]}</{tag}>"})
            obs, reward, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                return messages if game.success(float(reward), bool(terminated)) else None
            messages.append({"role": "user", "content": game.render(env, obs)})
        return None  # out of steps
    finally:
        env.close()


class GymSource(TaskSource):
    """Episodes of one gymnasium toy-text environment."""

    def __init__(self, env_id: str, *, eval_fraction: float = 0.1, options: GymOptions = GymOptions()):
        game_of(env_id)
        check_fraction(eval_fraction, "gym: eval_fraction")
        if options.random_map and not env_id.startswith("FrozenLake"):
            raise ValueError(f"gym: random_map applies to FrozenLake only, not {env_id!r}")
        self.env_id, self.eval_fraction, self.options = env_id, eval_fraction, options
        self.name = f"gym:{env_id}"
        try:
            GymTask(env_id, 0, options).make()[0].close()  # a wrong id or option fails here, by name
        except Exception as exc:
            raise ValueError(f"gym: cannot make {env_id!r} with {options.make_args}: {exc}") from exc

    def _draw(self, n: int, seed: int, *, evaluation: bool) -> list[GymTask]:
        rng = random.Random(derive_seed(seed, "gym-eval" if evaluation else "gym-train"))
        out: list[GymTask] = []
        while len(out) < n:
            s = rng.getrandbits(31)
            if held_out(str(s), self.eval_fraction) == evaluation:
                out.append(GymTask(self.env_id, s, self.options))
        return out

    def rows(self, n: int, *, seed: int) -> list[GymTask]:
        return self._draw(n, seed, evaluation=False)

    def eval_rows(self, n: int, *, seed: int) -> list[GymTask]:
        return self._draw(n, seed, evaluation=True)

    def demonstrations(self, n: int, *, seed: int) -> list[list[dict[str, str]]]:
        """Training episodes played to the goal by the best policy (`plan`: a shortest path on
        FrozenLake, CliffWalking and Taxi), each move as `<action>NAME</action>` and each answer
        as the environment renders it; episodes that miss the goal (slippery ice) are left out."""
        if not self.env_id.startswith(("FrozenLake", "Taxi", "CliffWalking")):
            raise NotImplementedError(
                f"{self.name} has no demonstrations: only FrozenLake, Taxi and CliffWalking have a "
                "transition table to plan a path on"
            )
        plans: dict[str, list[int]] = {}  # one per map: a random-map FrozenLake draws its own
        out: list[list[dict[str, str]]] = []
        tried = 0
        for batch in range(1, 64):
            for task in self.rows(n * batch, seed=seed)[tried:]:
                env, _ = task.make()
                key = str(env.unwrapped.desc.tolist()) if hasattr(env.unwrapped, "desc") else ""
                if key not in plans:
                    plans[key] = plan(env)
                env.close()
                demo = demonstration(task, plans[key])
                if demo is not None:
                    out.append(demo)
                    if len(out) == n:
                        return out
            tried = n * batch
        raise ValueError(f"{self.name}: {len(out)} of {tried} planned episodes reached the goal; wanted {n}")

    def option_defaults(self) -> dict[str, object]:
        return {
            **LONG_CONVERSATIONS,
            "max_new_tokens": 16,
        }  # `<action>south</action>` and a word or two

    def describe(self) -> dict[str, object]:
        o = self.options
        return {
            "name": self.name,
            "eval_fraction": self.eval_fraction,
            "max_steps": o.max_steps or game_of(self.env_id).max_steps,
            "invalid_penalty": o.invalid_penalty,
            "random_map": o.random_map,
            **o.make_args,
        }


def source(
    env_id: str,
    *,
    max_steps: int | None = None,
    invalid_penalty: float = 0.0,
    action_tag: str = "action",
    random_map: bool = False,
    map_size: int = 4,
    eval_fraction: float = 0.1,
    **make_args: object,
) -> GymSource:
    """The task source of `--task gym:ENV_ID`; `make_args` go to `gymnasium.make`."""
    if max_steps is not None and max_steps < 1:
        raise ValueError(f"gym: max_steps must be >= 1, got {max_steps}")
    options = GymOptions(
        max_steps=max_steps,
        invalid_penalty=invalid_penalty,
        action_tag=action_tag,
        random_map=random_map,
        map_size=map_size,
        make_args=make_args,
    )
    return GymSource(env_id, eval_fraction=eval_fraction, options=options)
