"""A key/value cache for `SDPACoreAttention` (the CPU layer spec), used by the generation engine.

megatron-core's own inference contexts need CUDA. This cache lives beside the model instead:
the engine attaches it to every `SDPACoreAttention` for the duration of a generate call, and
the model's forward is unchanged: packed (THD) input where packed sequence i continues cache
row `rows[i]`. The first forward of a call is the prefill (whole prompts, nothing cached);
every later one feeds one token per row. Keys are cached after the rotary embedding, which the
core attention applies at the row's true position (the number of tokens already cached).

Only this rank's attention heads are cached, so the cache works unchanged under TP.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from .spec import SDPACoreAttention, packed_positions


class KVCache:
    """Keys and values [rows, ng, capacity, hn] per layer, and the tokens cached per row."""

    def __init__(self, rows: int, capacity: int) -> None:
        self.capacity = capacity
        self.lengths = torch.zeros(rows, dtype=torch.int64)  # [rows] tokens cached per row
        self.rows = torch.arange(rows)  # [A] cache rows of the packed sequences fed next
        self._keys: dict[int, torch.Tensor] = {}  # layer number -> [rows, ng, capacity, hn]
        self._values: dict[int, torch.Tensor] = {}

    def select(self, rows: Sequence[int]) -> None:
        """The cache rows fed by the next forward, one packed sequence each, in order."""
        self.rows = torch.as_tensor(list(rows), dtype=torch.int64)

    @property
    def prefilling(self) -> bool:
        return not bool(self.lengths[self.rows].any())

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
        if self.prefilling:
            bounds = cu_seqlens.tolist()
            for row, start, end in zip(self.rows.tolist(), bounds[:-1], bounds[1:], strict=True):
                cache_k[row, :, : end - start] = keys[start:end].transpose(0, 1)
                cache_v[row, :, : end - start] = values[start:end].transpose(0, 1)
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
