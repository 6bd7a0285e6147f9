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
from collections.abc import Mapping, Sequence

from ..rollout.multiturn import MultiTurnScheduler
from ..rollout.rollouter import Rollout, Rollouter, Task
from ..types import Trajectory

__all__ = ["Task", "TaskSource"]


class TaskSource(ABC):
    """Where a step's rows come from (subclass it; only `rows` is required).

    Class attributes:
        name: shown in metrics and in the default output folder `runs/<name>-<time>`.
        trained_seats: the policy seats that yield a trajectory each (self-play: all of them).
        frozen_seats: policy seats the trainer fills with a frozen copy of the initial weights.
        eval_frozen_seats: seats evaluation rows may give that copy (`seat.frozen(name)` in a
            lineup), so that evaluation plays against the initial weights.
        reward_key: with a scheduler, the `rollout_infos` key that holds the environment reward.
    """

    name: str = "task"
    trained_seats: tuple[str, ...] = ("policy",)
    frozen_seats: tuple[str, ...] = ()
    eval_frozen_seats: tuple[str, ...] = ()
    reward_key: str = "reward"
    stop: tuple[str, ...] = ()  # strings that end a policy turn in this task (a tool call's close)

    @abstractmethod
    def rows(self, n: int, *, seed: int) -> Sequence[object]:
        """`n` training rows, a pure function of `seed` (the same on every resume)."""

    def eval_rows(self, n: int, *, seed: int) -> Sequence[object]:
        """`n` held-out rows, disjoint from every training row; [] when the source has none.

        Evaluation plays them with the trained policy in every policy seat.
        """
        return []

    def demonstrations(self, n: int, *, seed: int) -> list[list[dict[str, str]]]:
        """`n` conversations of the task's own solver in OpenAI message form (prompt included), for
        a supervised warm-up (`--sft-data`, `launch/demos.py`); a source without a solver has none."""
        raise NotImplementedError(f"task source {self.name!r} has no demonstrations(n, seed) of its own")

    def scheduler(self) -> object | None:
        """A `MultiTurnScheduler` selects the scheduler path; its rows are message lists or dicts.

        Another kind (an ms-swift scheduler) needs its own driver: that source overrides `run`.
        """
        return None

    def run(self, rollouter: Rollouter, rows: Sequence[object], step: int) -> Rollout:
        """This rank's `Rollout` of `rows` (collective): lineups, or the scheduler when there is one.

        A source whose rows need another driver (an ms-swift scheduler) overrides this; it
        takes what it needs from `rollouter.plan(rows, step)`: the samples (seeds, indices,
        groups, ids, as every path expands rows) and the engine, sampling and vote to run them.
        """
        scheduler = self.scheduler()
        if scheduler is not None and not isinstance(scheduler, MultiTurnScheduler):
            raise ValueError(
                f"task source {self.name!r}: scheduler() returned {type(scheduler).__name__}, which the "
                "native driver cannot run; return a MultiTurnScheduler, or override run() with its driver"
            )
        return rollouter.run(rows, step, scheduler, reward_key=self.reward_key)

    def evaluate(self, rollouter: Rollouter, rows: Sequence[object], step: int) -> Rollout:
        """Each held-out row played once with the trained policy in every policy seat (collective)."""
        return rollouter.evaluate(rows, step)

    def success_of(self, trajectory: Trajectory) -> float | None:
        """How a scored sample went, in [0, 1] (None: the task does not say).

        By default what its environments reported (`conv.infos["success"]` or the seat's
        `outcome`); a source without environments (a prompt dataset) decides from the reward.
        """
        return trajectory.infos.success

    def option_defaults(self) -> dict[str, object]:
        """Launch options this task runs best with, by option name (`max_new_tokens`, `model`...).

        The launch scripts use them in place of the library's defaults; the user's YAML and
        command line override them, and the script prints where each value came from.
        """
        return {}

    def dataset_of(self, row: object) -> str | None:
        """The dataset of a mix that `row` came from, for the per-dataset reward (None: not a mix)."""
        return None

    def describe(self) -> Mapping[str, object]:
        """What `run.json` records of this source (its options)."""
        return {"name": self.name}
