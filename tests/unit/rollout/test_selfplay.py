"""Multi-seat lineups through RolloutMixin: self-play, fixed and frozen opponents, per-seat groups."""

from __future__ import annotations

import asyncio

import pytest
import torch
from support.fakes import ForeignTrainer

from interlens_mcore.engines.hf import HFEngine
from interlens_mcore.rollout.conversation import Conversation, Environment, Scripted
from interlens_mcore.tasks import DuelTasks, GuessTasks, resolve_task
from interlens_mcore.tasks.duel import DuelReferee, DuelTask, duel_tasks
from interlens_mcore.tasks.guess import guess_tasks
from interlens_mcore.types import Message, Status

Trainer = ForeignTrainer  # an HF model, one process, no torch.distributed


def _judge(a: str, b: str, target: int = 5, closeness: float = 0.0) -> tuple[Conversation, DuelReferee]:
    task = DuelTask(target=target, form_weight=0.5, closeness_weight=closeness)
    referee = task.environment()
    players = [Scripted("player_a", [a], role="assistant"), Scripted("player_b", [b], role="assistant")]
    conv = Conversation([*players, referee], prompt=task.prompt())
    conv.start()
    for speaker in conv.lineup:
        conv.commit(speaker, Message(speaker=speaker.name, content=speaker.respond(conv), role=speaker.role))
    return conv, referee


def test_duel_referee_outcomes_and_rewards():
    conv, ref = _judge("4", "7")  # |4 - 5| = 1 beats |7 - 5| = 2
    assert conv.infos["outcome"] == {"player_a": 1.0, "player_b": 0.0}
    assert conv.messages[-1].content == "player_a wins" and conv.stop_reason == "judged"
    # form: "4" is a move in range (1.0); reward 0.5 * 1 + 0.5 * 1 = 1.0 for A, 0.5 * 1 + 0 = 0.5 for B
    assert ref.reward_for(conv, "player_a") == 1.0 and ref.reward_for(conv, "player_b") == 0.5
    conv, ref = _judge("x6", "4")  # both at distance 1: a tie; A's "x6" still names 6
    assert conv.infos["outcome"] == {"player_a": 0.5, "player_b": 0.5}
    assert ref.reward_for(conv, "player_a") == 0.5 * 1.0 + 0.5 * 0.5
    conv, ref = _judge("12", "4")  # out of range: no move, no form; 12 loses to 4 at distance 1
    assert ref.reward_for(conv, "player_a") == 0.5 * 0.0 + 0.5 * 0.0
    conv, ref = _judge("no", "9")  # a number beats no number, however far
    assert conv.infos["outcome"] == {"player_a": 0.0, "player_b": 1.0}
    conv, ref = _judge("no", "nope")  # nobody played: nobody scores the outcome
    assert conv.infos["outcome"] == {"player_a": 0.0, "player_b": 0.0}
    assert ref.reward_for(conv, "referee") is None  # not a seat
    conv, ref = _judge("4", "9", closeness=0.5)  # A wins at distance 1, B loses at distance 4
    # game part: 0.5 x outcome + 0.5 x (1 - distance / 8); A: 0.5 + 0.5 x 7/8, B: 0 + 0.5 x 4/8
    assert ref.reward_for(conv, "player_a") == 0.5 * 1.0 + 0.5 * (0.5 + 0.5 * 7 / 8)
    assert ref.reward_for(conv, "player_b") == 0.5 * 1.0 + 0.5 * (0.5 * 4 / 8)


def _duel_score(reply_for_target, seeds: int = 30) -> float:
    """player_a's mean reward against the random player_b, over every target x `seeds` games."""
    rewards = []
    for target in range(1, 10):
        task = DuelTask(target=target, random_seats=("player_b",))
        for seed in range(seeds):
            reply = reply_for_target(target)
            lineup = task.lineup(lambda name, reply=reply: Scripted(name, [reply], role="assistant"))
            conv = Conversation(lineup, prompt=task.prompt(), seed=seed)
            conv.start()
            for speaker in conv.lineup:
                said = speaker.respond(conv)
                conv.commit(speaker, Message(speaker=speaker.name, content=said, role=speaker.role))
            rewards.append(lineup[-1].reward_for(conv, "player_a"))
    return sum(rewards) / len(rewards)


def test_duel_reward_pays_for_playing_not_for_digits():
    """Naming the target outscores every fixed answer and every digit string."""
    playing = _duel_score(str)
    gaming = {
        **{f"always {v}": (lambda _t, v=v: str(v)) for v in range(1, 10)},
        "digit string": lambda _t: "123456789",
        "repeated numbers": lambda _t: "5 5 5 5 5 5",
        "digits and words": lambda _t: "5555 five 5555",
        "no number": lambda _t: "closest",
    }
    scores = {name: _duel_score(strategy) for name, strategy in gaming.items()}
    assert all(playing > score for score in scores.values()), scores
    assert scores["repeated numbers"] == pytest.approx(scores["always 5"])  # its first number
    assert scores["digit string"] == scores["no number"] == 0.0  # no move in range: nothing


def test_task_validation_and_sources():
    with pytest.raises(ValueError, match="target 12 lies outside"):
        DuelTask(target=12)
    with pytest.raises(ValueError, match="random_seats holds \\['player_c'\\]"):
        DuelTask(target=3, random_seats=("player_c",))
    with pytest.raises(ValueError, match="opponent must be one of self, random, frozen"):
        DuelTasks(opponent="mirror")
    with pytest.raises(ValueError, match="--task 'chess' is not a known task"):
        resolve_task("chess")
    with pytest.raises(ValueError, match="bad --task-args"):
        resolve_task("guess", {"opponent": "random"})  # guess has one seat: no opponent option
    assert GuessTasks().rows(3, seed=4) == guess_tasks(3, seed=4)
    assert DuelTasks().rows(3, seed=4) == duel_tasks(3, seed=4)
    assert DuelTasks(opponent="random").trained_seats == ("player_a",)
    frozen = DuelTasks(opponent="frozen")
    assert frozen.trained_seats == ("player_a",) and frozen.frozen_seats == ("player_b",)
    evals = DuelTasks().eval_rows(2, seed=0)
    assert [t.random_seats for t in evals] == [("player_b",)] * 2 + [("player_a",)] * 2
    # held out: drawn from another seed than the training rows of the same seed
    assert GuessTasks().eval_rows(8, seed=0) != GuessTasks().rows(8, seed=0)


def _scores(rollout) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for t in rollout.trajectories:
        out.setdefault(f"reward/{t.participant}", []).append(t.reward)
        out.setdefault(f"win_rate/{t.participant}", []).append(t.infos["success"])
    return out


def test_self_play_seats_views_rewards_and_groups(tiny):
    trainer = Trainer(*tiny, num_generations=4)
    rows = duel_tasks(2, seed=1)
    rollout = trainer.generate_rollouts(rows, step=0)
    trajs = rollout.trajectories
    # 2 rows x 4 samples x 2 seats, each seat from its own view
    assert len(trajs) == 16
    assert [t.participant for t in trajs[:4]] == ["player_a", "player_b"] * 2
    by_id = {c.id: c for c in rollout.conversations}
    for t in trajs:
        conv = by_id[t.infos["conversation"]]
        own = next(m for m in conv.messages if m.speaker == t.participant)
        (span,) = t.turns  # one trained turn per seat per game
        trained = [i for i, m in enumerate(t.loss_mask) if m]
        # exactly this seat's sampled ids carry loss mask 1; the other seat's are context
        assert [t.token_ids[i] for i in trained] == own.token_ids
        assert t.rollout_logprobs == own.logprobs
        assert t.reward == conv.lineup[-1].reward_for(conv, t.participant)
    a_view = next(t for t in trajs if t.participant == "player_a")
    b_view = next(
        t
        for t in trajs
        if t.participant == "player_b" and t.infos["conversation"] == a_view.infos["conversation"]
    )
    # B answered after reading A: A's reply, rendered once as a user message, precedes B's turn
    a_msg = next(m for m in by_id[a_view.infos["conversation"]].messages if m.speaker == "player_a")
    rendered = trainer.rollouter.seat("player_b").chat.message_ids("user", a_msg.content)
    b_start = b_view.turns[0].start
    assert any(b_view.token_ids[i : i + len(rendered)] == rendered for i in range(b_start))
    assert not any(b_view.loss_mask[:b_start])
    # advantages are centred per (prompt, seat): 4 groups of 4
    adv = rollout.advantages
    for row in range(2):
        for seat in ("player_a", "player_b"):
            idx = [i for i, t in enumerate(trajs) if t.group == row and t.participant == seat]
            assert len(idx) == 4 and abs(float(adv[idx].sum())) < 1e-5
    assert set(rollout.seat_rewards()) == {"player_a", "player_b"}
    assert sum(b.num_samples for b in trainer.training_batches(rollout)) == sum(
        t.num_trained_tokens > 0 and bool(k) for t, k in zip(trajs, rollout.keep)
    )


def test_random_opponent_trains_one_seat_and_evaluate(tiny):
    trainer = Trainer(*tiny, num_generations=2)
    rollout = trainer.generate_rollouts(DuelTasks(opponent="random").rows(2, seed=0), step=0)
    assert [t.participant for t in rollout.trajectories] == ["player_a"] * 4
    scores = _scores(trainer.evaluate(DuelTasks().eval_rows(3, seed=7), step=0))
    assert sorted(scores) == ["reward/player_a", "reward/player_b", "win_rate/player_a", "win_rate/player_b"]
    assert all(len(v) == 3 for v in scores.values())
    assert all(x in (0.0, 0.5, 1.0) for k, v in scores.items() if k.startswith("win") for x in v)


def test_frozen_opponent_seat(tiny, tiny_path):
    from transformers import AutoModelForCausalLM

    frozen = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_path), tiny[1], name="frozen")

    class VsFrozen(Trainer):
        frozen_seats = ("player_b",)

        def frozen_engine(self):
            return frozen

    trainer = VsFrozen(*tiny, num_generations=2)
    rollout = trainer.generate_rollouts(duel_tasks(1, seed=2), step=0)
    assert [t.participant for t in rollout.trajectories] == ["player_a"] * 2
    b_said = [m for c in rollout.conversations for m in c.messages if m.speaker == "player_b"]
    assert len(b_said) == 2 and all(m.token_ids for m in b_said)  # sampled by the frozen engine
    # evaluation measures the trained policy in every seat, the frozen one's included
    scores = _scores(trainer.evaluate(DuelTasks().eval_rows(2, seed=1), step=0))
    wins = sorted(k for k in scores if k.startswith("win_rate/"))
    assert wins == ["win_rate/player_a", "win_rate/player_b"]


def test_eval_opponents_random_and_initial_play_the_same_targets():
    source = DuelTasks(eval_opponents=["random", "initial"])
    assert source.eval_frozen_seats == ("player_a", "player_b") and source.frozen_seats == ()
    assert source.describe()["eval_opponents"] == ["random", "initial"]
    rows = source.eval_rows(3, seed=5)
    # per opponent, 3 games with player_a evaluated, then 3 with player_b
    assert [(t.random_seats, t.frozen_seats) for t in rows] == (
        [(("player_b",), ())] * 3
        + [(("player_a",), ())] * 3
        + [((), ("player_b",))] * 3
        + [((), ("player_a",))] * 3
    )
    assert [t.target for t in rows[:6]] == [t.target for t in rows[6:]]  # a paired comparison
    assert [t.opponent() for t in rows[::3]] == [
        ("random", "player_a"),
        ("random", "player_b"),
        ("initial", "player_a"),
        ("initial", "player_b"),
    ]
    assert DuelTasks().eval_frozen_seats == () and len(DuelTasks().eval_rows(3, seed=5)) == 6
    with pytest.raises(
        ValueError, match=r"eval_opponents holds \['mirror'\]; each must be one of random, initial"
    ):
        DuelTasks(eval_opponents=["random", "mirror"])
    with pytest.raises(ValueError, match="eval_opponents must be a non-empty list, got 'initial'"):
        DuelTasks(eval_opponents="initial")
    with pytest.raises(ValueError, match=r"seats \['player_b'\] are in both random_seats and frozen_seats"):
        DuelTask(target=3, random_seats=("player_b",), frozen_seats=("player_b",))
    with pytest.raises(ValueError, match="the seat callable has no .frozen"):
        DuelTask(target=3, frozen_seats=("player_b",)).lineup(lambda name: Scripted(name, ["1"]))


def test_referee_reports_the_win_against_a_fixed_opponent():
    task = DuelTask(target=5, frozen_seats=("player_a",))
    conv = Conversation(
        [
            Scripted("player_a", ["4"], role="assistant"),
            Scripted("player_b", ["5"], role="assistant"),
            task.environment(),
        ],
        prompt=task.prompt(),
    )
    conv.start()
    for speaker in conv.lineup:
        conv.commit(speaker, Message(speaker=speaker.name, content=speaker.respond(conv), role=speaker.role))
    # player_b (the evaluated seat) named the target against the initial weights' 4
    assert conv.infos["rate/win_vs_initial"] == conv.infos["rate/win_vs_initial/player_b"] == 1.0
    assert not any(k.startswith("rate/win_vs_random") for k in conv.infos)
    conv, _ = _judge("4", "7")  # self-play: no fixed opponent, no such rate
    assert not any(k.startswith("rate/") for k in conv.infos)


def test_evaluation_against_the_initial_weights(tiny, tiny_path):
    from transformers import AutoModelForCausalLM

    from trainers.report.record import sample_rates

    frozen = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_path), tiny[1], name="frozen")
    source = DuelTasks(eval_opponents=["random", "initial"])

    class VsInitial(Trainer):
        eval_frozen_seats = source.eval_frozen_seats

        def frozen_engine(self):
            return frozen

    trainer = VsInitial(*tiny)
    rollout = trainer.evaluate(source.eval_rows(2, seed=3), step=0)
    # one trajectory per game, the evaluated seat's: neither the random nor the frozen one trains
    assert [t.participant for t in rollout.trajectories] == [
        "player_a",
        "player_a",
        "player_b",
        "player_b",
    ] * 2
    rates = [sample_rates(t) for t in rollout.trajectories]
    seats = ["player_a", "player_a", "player_b", "player_b"]
    assert [sorted(r) for r in rates] == [
        sorted([f"rate/win_vs_{kind}", f"rate/win_vs_{kind}/{seat}"])
        for kind in ("random", "initial")
        for seat in seats
    ]
    assert all(
        t.infos["success"] == r[f"rate/win_vs_{k}"]
        for t, r, k in zip(rollout.trajectories, rates, ["random"] * 4 + ["initial"] * 4)
    )
    # the frozen seat's replies were sampled (they carry token ids): the frozen engine played them
    convs = rollout.conversations[4:]
    assert all(
        m.token_ids
        for c, seat in zip(convs, ["player_b", "player_b", "player_a", "player_a"])
        for m in c.messages
        if m.speaker == seat
    )
    # a training row that asks for the frozen copy when the source declared none for training
    with pytest.raises(
        ValueError, match="seat 'player_b' asks for the frozen initial weights, but the task source names"
    ):
        trainer.generate_rollouts([DuelTask(target=3, frozen_seats=("player_b",))], step=0)


class _Slow(Environment):
    """Answers at once, except in the conversations named in `slow`, where it never returns in time."""

    name = "slow"

    def __init__(self, slow: bool):
        self.slow = slow

    async def respond(self, conv):
        if self.slow:
            await asyncio.sleep(5)
        conv.request_stop("answered")
        return "ok"

    def reward(self, conv):
        return 1.0


class _SlowTask:
    max_turns = 4

    def __init__(self, slow: bool):
        self.slow = slow

    def prompt(self):
        return [Message(speaker="user", content="say something", role="user")]

    def lineup(self, seat):
        return [seat("policy"), _Slow(self.slow)]


class _MixedTask(_SlowTask):
    """Sample k of the row is slow when `slow[k]` (the environment counts the samples it served)."""

    def __init__(self, slow: list[bool]):
        self.slow, self.served = slow, 0

    def lineup(self, seat):
        self.served += 1
        return [seat("policy"), _Slow(self.slow[self.served - 1])]


@pytest.mark.parametrize("on_timeout", ["zero", "drop"])
def test_timed_out_samples_scored_or_dropped(tiny, on_timeout):
    trainer = Trainer(*tiny, num_generations=2, step_timeout_s=0.2, on_timeout=on_timeout)
    rollout = trainer.generate_rollouts([_SlowTask(False), _SlowTask(True)], step=0)
    status = [t.status for t in rollout.trajectories]
    assert status == [Status.STOPPED] * 2 + [Status.TIMEOUT] * 2 and rollout.timeouts == 2
    if on_timeout == "zero":
        # the timed-out group scores 0 and still trains (its advantages are 0: no spread)
        assert rollout.rewards.tolist() == [1.0, 1.0, 0.0, 0.0] and rollout.keep.all()
    else:
        assert rollout.keep.tolist() == [True, True, False, False]
        assert torch.equal(rollout.advantages[2:], torch.zeros(2))
        assert sum(b.num_samples for b in trainer.training_batches(rollout)) == 2


def test_drop_with_leave_one_out_leaves_lone_survivors_out(tiny):
    cfg = dict(step_timeout_s=0.2, on_timeout="drop", leave_one_out=True)
    # both samples of the slow task time out and leave; the fast task's pair trains
    rollout = Trainer(*tiny, num_generations=2, **cfg).generate_rollouts(
        [_SlowTask(False), _SlowTask(True)], 0
    )
    assert rollout.keep.tolist() == [True, True, False, False]
    # three samples in one group, two time out: the lone survivor has no
    # leave-one-out baseline, so it leaves too instead of failing this rank alone
    rows = [_MixedTask([False, True, True])]
    rollout = Trainer(*tiny, num_generations=3, **cfg).generate_rollouts(rows, 0)
    assert [t.status for t in rollout.trajectories] == [Status.STOPPED, Status.TIMEOUT, Status.TIMEOUT]
    assert rollout.keep.tolist() == [False, False, False]
    assert torch.equal(rollout.advantages, torch.zeros(3))


def test_guess_still_one_seat(tiny):
    rollout = Trainer(*tiny, num_generations=2).generate_rollouts(guess_tasks(1, seed=0), step=0)
    assert [t.participant for t in rollout.trajectories] == ["policy", "policy"]
