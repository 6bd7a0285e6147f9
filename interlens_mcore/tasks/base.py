"""Task sources: where a step's rows come from, and how a row lays out its conversation.

A row is a `Task`: an opening transcript, a lineup (the participants in speaking order, with a
policy asked for by seat name) and a turn cap. A `TaskSource` draws a step's rows from a seed
alone (so a resumed run replays them) and, when it can, a held-out evaluation set that never
overlaps the training rows.

Environments report how a conversation went through `conv.infos`:

- `conv.infos["success"]`: a float in [0, 1] for single-seat tasks (1 solved, 0 not);
- `conv.infos["outcome"]`: seat name -> 1 win, 1/2 tie, 0 loss, for multi-seat games.

Evaluation averages them into `eval/success_rate` (and `eval/win_rate/<seat>`).

A minimal task source::

    class Echo(Environment):
        def respond(self, conv):
            conv.infos["success"] = float("hello" in conv.messages[-1].content)
            conv.request_stop("judged")
            return "thanks"

        def reward(self, conv):
            return conv.infos["success"]

    @dataclass(frozen=True)
    class SayHello:
        max_turns: int = 2

        def prompt(self):
            return [Message(speaker="user", content="say hello")]

        def lineup(self, seat):
            return [seat("policy"), Echo("judge")]

    class HelloTasks(TaskSource):
        name = "hello"

        def rows(self, n, *, seed):
            return [SayHello() for _ in range(n)]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

from ..rollout.conversation import Participant, Policy  # noqa: F401  (the types of Task.lineup)
from ..types import Message


class Task(Protocol):
    """One row of a step: an opening transcript, a lineup, and a turn cap.

    `lineup(seat)` returns the participants in speaking order; `seat(name)` is the trainer's
    policy for a seat (trained, or frozen when the task source says so), so the task decides
    which seats a policy plays and which an environment or fixed opponent takes.
    """

    max_turns: int

    def prompt(self) -> list[Message]: ...

    def lineup(self, seat: Callable[[str], Policy]) -> list[Participant]: ...


class TaskSource(ABC):
    """Where a step's rows come from (subclass it; only `rows` is required).

    Class attributes:
        name: shown in metrics and in the default output folder `runs/<name>-<time>`.
        trained_seats: the policy seats that yield a trajectory each (self-play: all of them).
        frozen_seats: policy seats the trainer fills with a frozen copy of the initial weights.
        reward_key: with a scheduler, the `rollout_infos` key that holds the environment reward.
    """

    name: str = "task"
    trained_seats: tuple[str, ...] = ("policy",)
    frozen_seats: tuple[str, ...] = ()
    reward_key: str = "reward"
    stop: tuple[str, ...] = ()  # strings that end a policy turn in this task (a tool call's close)

    @abstractmethod
    def rows(self, n: int, *, seed: int) -> list[Any]:
        """`n` training rows, a pure function of `seed` (the same on every resume)."""

    def eval_rows(self, n: int, *, seed: int) -> list[Any]:
        """`n` held-out rows, disjoint from every training row; [] when the source has none.

        Evaluation plays them with the trained policy in every policy seat.
        """
        return []

    def scheduler(self) -> Any | None:
        """A `MultiTurnScheduler` selects the scheduler path; its rows are message lists or dicts."""
        return None

    def run(self, rollouter: Any, rows: list[Any], step: int) -> Any:
        """This rank's `Rollout` of `rows` (collective): lineups, or the scheduler when there is one.

        A source whose rows need another driver (an ms-swift scheduler) overrides this.
        """
        return rollouter.run(rows, step, self.scheduler(), reward_key=self.reward_key)

    def evaluate(self, rollouter: Any, rows: list[Any], step: int) -> Any:
        """Each held-out row played once with the trained policy in every policy seat (collective)."""
        return rollouter.evaluate(rows, step)

    def success_of(self, trajectory: Any) -> float | None:
        """How a scored sample went, in [0, 1] (None: the task does not say).

        By default what its environments reported (`conv.infos["success"]` or the seat's
        `outcome`); a source without environments (a prompt dataset) decides from the reward.
        """
        return trajectory.infos.get("success")

    def option_defaults(self) -> dict[str, object]:
        """Launch options this task runs best with, by option name (`max_new_tokens`, `model`...).

        The launch scripts use them in place of the library's defaults; the user's YAML and
        command line override them, and the script prints where each value came from.
        """
        return {}

    def dataset_of(self, row: object) -> str | None:
        """The dataset of a mix that `row` came from, for the per-dataset reward (None: not a mix)."""
        return None

    def describe(self) -> dict[str, Any]:
        """What `run.json` records of this source (its options)."""
        return {"name": self.name}
