"""The judge on real gloo ranks: uneven sample counts (none at all on one rank) finish in
lockstep, and one rank's bad row is the same error on both ranks, never a hang."""

from __future__ import annotations

from support.dist import run_ranks

TEMPLATE = "Question: {prompt}\nAnswer: {completion}\nReference: {solution}\nscore:"


class Counting:
    """Spy around the judge's real engine: the rows of each generate call."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.name, self.max_context, self.tokenizer = engine.name, engine.max_context, engine.tokenizer

    def generate(self, requests):
        self.calls.append(len(requests))
        return self.engine.generate(requests)


def _samples(rank, n, status):
    from interlens_mcore.types import Trajectory, TrajectoryInfo

    return [
        Trajectory(
            token_ids=[1, 2],
            loss_mask=[0, 1],
            rollout_logprobs=None,
            status=status,
            infos=TrajectoryInfo(
                conversation=f"r{rank}-{i}",
                completion=str(i),
                env_reward=0.0,
                messages=[{"role": "user", "content": f"{i} + 1?"}, {"role": "assistant", "content": str(i)}],
            ),
        )
        for i in range(n)
    ]


def _judge_on_rank(rank, world, tiny_path, template_path, counts, rows_by_rank):
    from interlens_mcore import distributed
    from interlens_mcore.rewards.judge import Judge, JudgeError, Template, load_engine
    from interlens_mcore.types import Status

    groups = distributed.build_groups(rollout="world", vote_timeout_s=60)
    judge = Judge(tiny_path, Template.read(template_path), max_new_tokens=3, **_vote(groups))
    judge._engine = spy = Counting(load_engine(judge.path))
    trajs = _samples(rank, counts[rank], Status.STOPPED)
    out = []
    for rows in rows_by_rank[rank]:  # one scoring per entry: every rank scores as often
        try:
            out.append(("ok", judge(trajs, rows[: len(trajs)])))
        except JudgeError as exc:
            out.append(("error", str(exc)))
    return out, spy.calls


def _vote(groups):
    return {"gather_fn": groups.gather_fn(), "rank": groups.rank}


def test_uneven_samples_finish_and_make_the_same_calls(tiny_path, tmp_path):
    template = tmp_path / "judge.txt"
    template.write_text(TEMPLATE)
    good = [{"solution": "1"}] * 5
    rows = {0: [good, good], 1: [good, good]}
    (out0, calls0), (out1, calls1) = run_ranks(
        _judge_on_rank, 2, str(tiny_path), str(template), {0: 5, 1: 0}, rows, timeout=300
    )
    assert [s for s, _ in out0] == ["ok", "ok"] and [len(v) for _, v in out0] == [5, 5]
    assert out1 == [("ok", []), ("ok", [])]
    # the rank without samples joins every call with an empty batch
    assert calls0 == [5, 5] and calls1 == [0, 0]


def test_a_bad_row_on_one_rank_fails_both_ranks_alike(tiny_path, tmp_path):
    template = tmp_path / "judge.txt"
    template.write_text(TEMPLATE)
    good, bad = [{"solution": "1"}] * 3, [{"answer": "1"}] * 3
    rows = {0: [good, good], 1: [bad, good]}  # rank 1's first rows lack {solution}
    (out0, calls0), (out1, calls1) = run_ranks(
        _judge_on_rank, 2, str(tiny_path), str(template), {0: 3, 1: 1}, rows, timeout=300
    )
    for out in (out0, out1):
        assert out[0][0] == "error" and "rank 1: JudgeTemplateError" in out[0][1]
        assert "placeholder {solution} is not filled" in out[0][1]
        assert out[1][0] == "ok"  # the next scoring runs on both ranks: nothing was left waiting
    assert calls0 == [3] and calls1 == [1]


def _weighted_on_rank(rank, world, tiny_path, template_path):
    from interlens_mcore import distributed
    from interlens_mcore.grpo.rewards import WeightedRewards, environment_reward
    from interlens_mcore.rewards.judge import Judge, Template
    from interlens_mcore.types import Status

    groups = distributed.build_groups(rollout="world", vote_timeout_s=60)
    judge = Judge(tiny_path, Template.read(template_path), max_new_tokens=3, **_vote(groups))
    # rank 1's samples all failed earlier in the rollout: it still joins the judge's round
    trajs = _samples(rank, 3, Status.STOPPED if rank == 0 else Status.FAILED)
    rewards = WeightedRewards([environment_reward, judge])
    totals, parts = rewards.score(trajs, [{"solution": "1"}] * 3)
    return len(totals), [t.status.value for t in trajs]


def test_a_rank_whose_samples_all_failed_joins_the_judges_round(tiny_path, tmp_path):
    template = tmp_path / "judge.txt"
    template.write_text(TEMPLATE)
    (n0, status0), (n1, status1) = run_ranks(_weighted_on_rank, 2, str(tiny_path), str(template), timeout=300)
    assert n0 == n1 == 3 and status0 == ["stopped"] * 3 and status1 == ["failed"] * 3
