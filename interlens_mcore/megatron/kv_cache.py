"""A key/value cache for `SDPACoreAttention` (the CPU layer spec), used by the generation engine.

megatron-core's own inference contexts need CUDA. This cache lives beside the model instead:
the engine attaches it to every `SDPACoreAttention` for the duration of a generate call, and
the model's forward is unchanged: packed (THD) input where packed sequence i continues cache
row `rows[i]`. The first forward of a row is its prefill: its whole prompt, or, when `seed` put
an earlier turn's keys/values in the row, the prompt's part after them; every later forward
feeds one token per row. Keys are cached after the rotary embedding, which the core attention
applies at the row's true position (the number of tokens already cached).

Only this rank's attention heads are cached, so the cache works unchanged under TP.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..engines.prefix_cache import common_prefix
from .spec import SDPACoreAttention, packed_positions


class KVCache:
    """Keys and values [rows, ng, capacity, hn] per layer, and the tokens cached per row."""

    def __init__(self, rows: int, capacity: int) -> None:
        self.capacity = capacity
        self.lengths = torch.zeros(rows, dtype=torch.int64)  # [rows] tokens cached per row
        self.fed = torch.zeros(rows, dtype=torch.bool)  # [rows] the row's prefill forward ran
        self.rows = torch.arange(rows)  # [A] cache rows of the packed sequences fed next
        self._keys: dict[int, torch.Tensor] = {}  # layer number -> [rows, ng, capacity, hn]
        self._values: dict[int, torch.Tensor] = {}

    def select(self, rows: Sequence[int]) -> None:
        """The cache rows fed by the next forward, one packed sequence each, in order."""
        self.rows = torch.as_tensor(list(rows), dtype=torch.int64)

    @property
    def prefilling(self) -> bool:
        """The next forward is the selected rows' prefill (any tokens cached came from `seed`)."""
        return not bool(self.fed[self.rows].any())

    def seed(self, row: int, kv: dict[int, tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
        """Put the first `n` tokens' keys/values (per layer [ng, >= n, hn]) of an earlier call in
        `row`, before its prefill: that prefill then feeds only the tokens after them."""
        assert not bool(self.fed[row]) and int(self.lengths[row]) == 0, "seed a row before its prefill"
        if n > self.capacity:
            raise ValueError(f"KVCache overflow: seeding {n} > {self.capacity} tokens")
        for layer, (keys, values) in kv.items():
            if layer not in self._keys:
                shape = (self.lengths.numel(), keys.shape[0], self.capacity, keys.shape[2])
                self._keys[layer], self._values[layer] = keys.new_zeros(shape), values.new_zeros(shape)
            self._keys[layer][row, :, :n] = keys[:, :n]
            self._values[layer][row, :, :n] = values[:, :n]
        self.lengths[row] = n

    def cached(self) -> torch.Tensor:
        """[A] tokens each selected row holds before the fed ones (seeded ones, at a prefill)."""
        return self.lengths[self.rows]

    def row(self, layer: int, i: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys, values [ng, width, hn] of the i-th selected row's first `width` positions."""
        r = int(self.rows[i])
        return self._keys[layer][r, :, :width], self._values[layer][r, :, :width]

    def export(self, row: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Copies of `row`'s cached keys/values per layer, [ng, lengths[row], hn] each."""
        n = int(self.lengths[row])
        return {
            layer: (self._keys[layer][row, :, :n].clone(), self._values[layer][row, :, :n].clone())
            for layer in self._keys
        }

    def positions(self, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Position of every fed token [T]: its row's cached length plus its offset in the chunk."""
        cu = cu_seqlens.cpu()  # the bookkeeping stays on the CPU; positions go to the input's device
        chunk = (cu[1:] - cu[:-1]).to(torch.int64)  # [A]
        assert chunk.numel() == self.rows.numel(), "one packed sequence per selected cache row"
        assert self.prefilling or bool((chunk == 1).all()), "after the prefill, one token per row"
        offsets = torch.repeat_interleave(self.lengths[self.rows], chunk) + packed_positions(cu)
        return offsets.to(cu_seqlens.device)

    def store(self, layer: int, keys: torch.Tensor, values: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
        """Write the fed tokens' keys/values [T, ng, hn] (keys already rotated) into `layer`."""
        if layer not in self._keys:
            shape = (self.lengths.numel(), keys.shape[1], self.capacity, keys.shape[2])
            self._keys[layer] = keys.new_zeros(shape)
            self._values[layer] = values.new_zeros(shape)
        cache_k, cache_v = self._keys[layer], self._values[layer]
        if self.prefilling:  # after any seeded tokens
            bounds = cu_seqlens.tolist()
            cached = self.lengths[self.rows].tolist()
            for row, c, start, end in zip(self.rows.tolist(), cached, bounds[:-1], bounds[1:], strict=True):
                cache_k[row, :, c : c + end - start] = keys[start:end].transpose(0, 1)
                cache_v[row, :, c : c + end - start] = values[start:end].transpose(0, 1)
        else:
            at = self.lengths[self.rows]  # [A] one token per row, written after its cached ones
            cache_k[self.rows, :, at] = keys  # [A, ng, hn]
            cache_v[self.rows, :, at] = values

    def window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values [A, ng, L, hn] of the selected rows including the token just stored, and
        the mask [A, 1, 1, L] of the positions each row may attend to (its own, cached ones)."""
        seen = self.lengths[self.rows] + 1  # [A]
        width = int(seen.max())
        mask = (torch.arange(width)[None, :] < seen[:, None]).to(self._keys[layer].device)  # [A, L]
        keys = self._keys[layer][self.rows, :, :width]
        values = self._values[layer][self.rows, :, :width]
        return keys, values, mask[:, None, None, :]

    def advance(self, cu_seqlens: torch.Tensor) -> None:
        """Count the tokens fed by the forward that just ran (call once per model forward)."""
        cu = cu_seqlens.cpu()
        self.lengths[self.rows] += (cu[1:] - cu[:-1]).to(torch.int64)
        self.fed[self.rows] = True
        if int(self.lengths.max()) > self.capacity:
            raise ValueError(
                f"KVCache overflow: a row holds {int(self.lengths.max())} > {self.capacity} tokens"
            )


def supports_kv_cache(model: torch.nn.Module) -> bool:
    """True when every core attention of `model` is an SDPACoreAttention applying RoPE itself."""
    cores = [m for m in model.modules() if isinstance(m, SDPACoreAttention)]
    return bool(cores) and all(m.rotary_base is not None for m in cores)


@contextmanager
def attached(model: torch.nn.Module, cache: KVCache) -> Iterator[KVCache]:
    """Route every SDPACoreAttention of `model` through `cache` inside the block."""
    if not supports_kv_cache(model):
        raise ValueError("KVCache needs the CPU layer spec (SDPACoreAttention applying RoPE itself)")
    cores = [m for m in model.modules() if isinstance(m, SDPACoreAttention)]
    for m in cores:
        m.kv_cache = cache
    try:
        yield cache
    finally:
        for m in cores:
            m.kv_cache = None


@dataclass
class _Kept:
    ids: list[int]  # the tokens whose keys/values `kv` holds, in order
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer number -> keys, values [ng, len(ids), hn]
    nbytes: int


class PrefixStore:
    """The keys/values each tagged row left after a generate call, for the tag's next call.

    Checked by content, not trusted by tag: a row reuses the longest common prefix of its prompt
    and an entry of its tag (at most all but the prompt's last token, which is fed for the
    next-token logits). A tag keeps up to `per_tag` entries (the speakers of one conversation see
    different prompts); tags are evicted least recently used beyond `max_bytes`. Every decision
    depends on token ids and sizes only, alike on every rank of a TP group, so each rank's forward
    feeds the same tokens. The weights are not checked here: the engine clears the store when they
    change.
    """

    def __init__(self, max_bytes: int, per_tag: int = 4) -> None:
        self.max_bytes, self.per_tag = max_bytes, per_tag
        self._tags: OrderedDict[str, list[_Kept]] = OrderedDict()
        self.nbytes = 0

    def clear(self) -> None:
        self._tags.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return sum(len(v) for v in self._tags.values())

    def lookup(self, tag: str, prompt: Sequence[int]) -> tuple[_Kept | None, int]:
        """The entry of `tag` sharing the longest prefix with `prompt`, and that prefix's length."""
        best: tuple[_Kept | None, int] = (None, 0)
        for kept in self._tags.get(tag, []) if tag else []:
            n = common_prefix(kept.ids, prompt, len(prompt) - 1)
            if n > best[1]:
                best = (kept, n)
        return best

    def keep(self, tag: str, ids: list[int], kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv.values())
        if not tag or not ids or nbytes > self.max_bytes:
            return
        old = self._tags.pop(tag, [])
        covered = [e for e in old if e.ids == ids[: len(e.ids)]]  # the new entry extends these
        self.nbytes -= sum(e.nbytes for e in covered)
        entries = [_Kept(ids, kv, nbytes), *(e for e in old if all(e is not c for c in covered))]
        for e in entries[self.per_tag :]:
            self.nbytes -= e.nbytes
        self._tags[tag] = entries[: self.per_tag]
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:  # the least recently kept tags go first
            _, dropped = self._tags.popitem(last=False)
            self.nbytes -= sum(e.nbytes for e in dropped)
