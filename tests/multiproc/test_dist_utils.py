import time

import pytest
from support.dist import run_ranks


def _sum_ranks(rank, world):
    import torch

    from interlens_mcore import distributed

    t = torch.tensor([float(rank + 1)])
    distributed.all_reduce(t)
    return float(t), distributed.all_gather_object(rank)


def _hang_on_rank1(rank, world):
    import torch.distributed as dist

    if rank == 1:
        time.sleep(600)
    dist.barrier()


def test_two_ranks_reduce_and_gather():
    assert run_ranks(_sum_ranks, 2) == [(3.0, [0, 1]), (3.0, [0, 1])]


@pytest.mark.slow  # not a first path: the slow stage (README, Set-up)
def test_hang_is_a_failure():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        run_ranks(_hang_on_rank1, 2, timeout=8)
    assert time.monotonic() - t0 < 30


def _gather_small_and_large(rank, world):
    from interlens_mcore import distributed

    small = distributed.all_gather_small({"rank": rank, "rows": {"k": ("policy", rank)}})
    # one rank's object overflows the fast buffer: both ranks fall back together
    large = distributed.all_gather_small("x" * (10_000 if rank == 1 else 3))
    return small, [len(x) for x in large]


def test_all_gather_small_fast_path_and_fallback():
    out = run_ranks(_gather_small_and_large, 2)
    expected_small = [{"rank": 0, "rows": {"k": ("policy", 0)}}, {"rank": 1, "rows": {"k": ("policy", 1)}}]
    assert out == [(expected_small, [3, 10_000])] * 2
