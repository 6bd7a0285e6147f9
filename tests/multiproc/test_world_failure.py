"""`distributed.check_world`: one rank's error reaches every rank as the same named cause.

Real gloo processes. The vanished-peer case needs its own two processes (not
`support.dist.run_ranks`, which fails a test as soon as any rank dies): rank 1 SIGKILLs itself
and rank 0 must raise a `WorldFailure` within seconds, not after the group's timeout.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch.multiprocessing as mp
from support.dist import free_port, run_ranks

SCENARIOS = ([], [1], [0, 1])  # which ranks fail, in one job (spawning ranks is the slow part)


def _check_job(rank, world_size):
    from interlens_mcore import distributed

    group = distributed.world_check_group(timeout_s=30)
    out = []
    for failing in SCENARIOS:
        error = ValueError(f"environment of rank {rank} exploded") if rank in failing else None
        try:
            distributed.check_world(error, group)
            out.append(None)
        except distributed.WorldFailure as exc:
            out.append({"message": str(exc), "failures": exc.failures, "chained": exc.__cause__ is error})
    return out


@pytest.fixture(scope="module")
def checked():
    return run_ranks(_check_job, 2, timeout=60)


@pytest.mark.parametrize(
    "scenario, message",
    [
        (1, "rank 1 failed: ValueError: environment of rank 1 exploded"),
        (2, "rank 0 failed: ValueError: environment of rank 0 exploded (rank 1 failed too)"),
    ],
)
def test_every_rank_raises_the_same_named_cause(checked, scenario, message):
    results = [r[scenario] for r in checked]
    assert [r["message"] for r in results] == [message, message]
    failing = SCENARIOS[scenario]
    assert results[0]["failures"] == [(r, f"ValueError: environment of rank {r} exploded") for r in failing]
    # chained to the rank's own error where it failed (to nothing elsewhere)
    assert [r["chained"] for r in results] == [True, True]


def test_nobody_failing_raises_nothing_and_the_checks_stay_aligned(checked):
    # scenario 0 returned on both ranks, and the failing scenarios after it still matched up
    assert [r[0] for r in checked] == [None, None]
    assert all(r[2] is not None for r in checked)


def test_one_rank_alone_raises_its_own_error():
    from interlens_mcore import distributed

    distributed.check_world(None)
    with pytest.raises(distributed.WorldFailure, match="^rank 0 failed: KeyError: 'seat'$"):
        distributed.check_world(KeyError("seat"))


def _killed_peer(rank: int, port: int, queue) -> None:
    import datetime

    import torch.distributed as dist

    from interlens_mcore import distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # the trainers' default timeout: a hang would show as a test timeout, not a quick failure
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=1800))
    group = distributed.world_check_group(timeout_s=1800)
    distributed.check_world(None, group)
    if rank == 1:
        time.sleep(0.5)  # rank 0 is inside the next check by now
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        distributed.check_world(None, group)
        queue.put(("returned", 0.0))
    except distributed.WorldFailure as exc:
        queue.put((str(exc), time.monotonic() - start))


def test_a_killed_peer_becomes_a_world_failure_within_seconds():
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_killed_peer, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        message, waited = queue.get(timeout=60)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert procs[1].exitcode == -signal.SIGKILL
    assert message.startswith("a rank left the world before reporting (")
    assert waited < 10.0, waited  # gloo sees the closed connection; measured about 0.5 s (the sleep)


def _phase_job(rank, world_size):
    """Inside a local phase a world collective raises at once, on the rank that attempts it."""
    from interlens_mcore import distributed

    out = {}
    try:
        with distributed.stage("step 3"), distributed.local_phase("evaluation"):
            if rank == 1:  # only rank 1 tries: it must raise without waiting for rank 0
                distributed.all_gather_object("figures")
    except distributed.CollectiveInLocalPhase as exc:
        out["refused"] = str(exc)
        out["notes"] = list(exc.__notes__)
    allowed = distributed.world_check_group(timeout_s=30)  # collective: both ranks, after the phase
    with distributed.local_phase("rollout", allow=(allowed,)):
        out["allowed"] = distributed.all_gather_object(rank, group=allowed)  # the rollout's own group
    return out


def test_a_world_collective_inside_a_local_phase_is_refused_at_once():
    results = run_ranks(_phase_job, 2, timeout=60)
    assert "refused" not in results[0]
    message = results[1]["refused"]
    assert message.startswith(
        "all_gather_object over ranks (0, 1) inside the local phase 'step 3 / evaluation'"
    )
    assert "move it after the check" in message
    assert results[1]["notes"] == ["during stage 'step 3 / evaluation'"]
    assert [r["allowed"] for r in results] == [[0, 1], [0, 1]]


def _timeout_job(rank, world_size):
    """Rank 0 waits in a gather rank 1 never joins: a named CollectiveError after the group's timeout."""
    from interlens_mcore import distributed

    group = distributed.world_check_group(timeout_s=2)
    if rank == 1:
        time.sleep(6)  # past rank 0's timeout, then leave without joining
        return None
    start = time.monotonic()
    try:
        with distributed.stage("step 3"), distributed.stage("evaluation figures"):
            distributed.all_gather_object({"reward": [1.0]}, group=group)
    except distributed.CollectiveError as exc:
        return {"message": str(exc), "waited": time.monotonic() - start, "notes": list(exc.__notes__)}
    return {"message": "returned"}


def test_a_collective_left_waiting_fails_after_its_timeout_naming_it_and_the_stage():
    results = run_ranks(_timeout_job, 2, timeout=90)
    got = results[0]
    assert got["message"].startswith(
        "all_gather_object over ranks (0, 1) failed during 'step 3 / evaluation figures': "
    ), got
    assert got["waited"] < 6.0, got  # the 2 s timeout, not rank 1 coming back (measured about 2 s)
    assert got["notes"] == ["during stage 'step 3 / evaluation figures'"]


def test_stages_nest_and_unwind():
    from interlens_mcore import distributed

    assert distributed.current_stage() is None
    with distributed.stage("step 0"):
        with distributed.local_phase("rollout"):
            assert distributed.current_stage() == "step 0 / rollout"
            distributed.all_gather_object("alone")  # a one-rank world: nothing to refuse, nothing sent
        assert distributed.current_stage() == "step 0"
    assert distributed.current_stage() is None
