"""PrefixStore: which kept keys/values a MegatronEngine row reuses, and what it forgets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from interlens_mcore.megatron.kv_cache import KVCache, PrefixStore

ROOT = Path(__file__).resolve().parents[3]


def _kv(n: int, fill: float = 1.0) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Two layers of keys/values for n tokens ([ng=2, n, hn=4] float32: 64 bytes a token)."""
    return {layer: (torch.full((2, n, 4), fill), torch.full((2, n, 4), -fill)) for layer in (1, 2)}


def test_a_row_reuses_the_longest_common_prefix_of_its_tag_but_never_its_last_token():
    store = PrefixStore(max_bytes=1 << 20)
    store.keep("c0", [1, 2, 3, 4, 5], _kv(5))
    kept, n = store.lookup("c0", [1, 2, 3, 4, 5, 6, 7])
    assert kept is not None and n == 5
    assert store.lookup("c0", [1, 2, 3, 4, 5])[1] == 4  # the last prompt token is fed for its logits
    assert store.lookup("c0", [1, 2, 9, 9])[1] == 2  # an edited history: the part before the edit
    assert store.lookup("c1", [1, 2, 3, 4, 5, 6]) == (None, 0)  # another conversation's entry
    assert store.lookup("", [1, 2, 3]) == (None, 0)  # an untagged row keeps and reuses nothing


def test_two_speakers_of_one_conversation_keep_an_entry_each_and_a_longer_one_replaces_its_prefix():
    store = PrefixStore(max_bytes=1 << 20)
    store.keep("g", [1, 2, 3], _kv(3))  # player_0's view
    store.keep("g", [7, 8, 9], _kv(3))  # player_1's view of the same game
    assert store.lookup("g", [1, 2, 3, 4])[1] == 3 and store.lookup("g", [7, 8, 9, 4])[1] == 3
    store.keep("g", [1, 2, 3, 4, 5], _kv(5))  # player_0's next turn covers its old entry
    assert len(store) == 2 and store.nbytes == 5 * 128 + 3 * 128
    assert store.lookup("g", [1, 2, 3, 4, 5, 6])[1] == 5


def test_tags_beyond_the_byte_budget_are_dropped_least_recent_first():
    store = PrefixStore(max_bytes=10 * 128)  # 10 tokens of _kv
    store.keep("a", [1] * 4, _kv(4))
    store.keep("b", [2] * 4, _kv(4))
    store.keep("a", [1] * 5, _kv(5))  # "a" is now the most recent: "b" goes when "c" comes
    store.keep("c", [3] * 4, _kv(4))
    assert store.lookup("b", [2] * 6) == (None, 0)
    assert store.lookup("a", [1] * 6)[1] == 5 and store.lookup("c", [3] * 6)[1] == 4
    assert store.nbytes == 9 * 128 <= store.max_bytes
    store.keep("huge", [4] * 11, _kv(11))  # alone over the budget: not kept, nothing evicted
    assert store.lookup("huge", [4] * 12) == (None, 0) and len(store) == 2
    store.clear()
    assert len(store) == 0 and store.nbytes == 0


def test_a_seeded_cache_row_continues_after_the_kept_tokens():
    cache = KVCache(rows=2, capacity=8)
    cache.seed(1, _kv(3, fill=2.0), 3)
    cache.select([0, 1])
    assert cache.prefilling and cache.cached().tolist() == [0, 3]
    cu = torch.tensor([0, 2, 4])  # row 0 feeds 2 tokens, row 1 its 2 tokens after the kept 3
    assert cache.positions(cu).tolist() == [0, 1, 3, 4]
    keys = torch.arange(4 * 2 * 4, dtype=torch.float32).reshape(4, 2, 4)
    cache.store(1, keys, -keys, cu)
    k, _ = cache.row(1, 1, 5)  # the second selected row: 3 kept tokens, then its 2 fed ones
    assert torch.equal(k[:, :3], torch.full((2, 3, 4), 2.0))
    assert torch.equal(k[:, 3:], keys[2:4].transpose(0, 1))
    cache.advance(cu)
    assert not cache.prefilling and cache.lengths.tolist() == [2, 5]
    exported = cache.export(1)
    assert exported[1][0].shape == (2, 5, 4) and exported[2][0].shape == (2, 5, 4)


@pytest.mark.slow  # not a first path: the slow stage (README, Set-up)
def test_bench_turns_megatron_samples_the_same_tokens_with_and_without_kept_prefixes():
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_turns.py"),
        *("--engine", "megatron", "--turns", "3", "--conversations", "4", "--max-new-tokens", "4"),
        *("--repeats", "1", "--threads", "1", "--json"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (run,) = out["runs"]
    assert out["same_tokens"] and run["reused_tokens"] > run["prefill_tokens_reuse"] > 0
    machine = out["machine"]
    assert machine["cores"] >= 1 and machine["load_before"] >= 0 and isinstance(machine["noisy"], bool)
