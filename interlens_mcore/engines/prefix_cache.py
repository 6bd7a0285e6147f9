"""Key/value reuse across turns: a turn encodes only what was appended since the last one.

A multi-turn conversation's next prompt is its previous prompt, the sampled ids, the template's
close, the other speakers' messages and a new generation prompt. `PrefixCachingEngine` keeps,
per request tag (the conversation id under `co_step`), the keys and values of every token it
already fed the model, and on the next call starts the prefill where that prefix ends.

A tag keeps several entries (`per_tag`): the policy seats of one conversation (self-play, two
trained players on one engine) share its tag but each sees the conversation from its own side,
so each seat's prompt continues its own last entry, not the other seat's. One entry a tag would
let the seats evict each other at every turn.

Example::

    engine = PrefixCachingEngine(model, tokenizer)
    policy = Policy("policy", engine, tokenizer)
    co_step(convs, turns=None)       # turn k encodes only turn k's new tokens
    optimizer.step(); engine.clear()  # cached keys/values belong to the old weights

The cache is checked by content, not trusted by tag: a row reuses the longest common prefix of
its prompt and the entry of its tag that shares the most (at most all but the last prompt token,
which must be fed to get the next-token logits). A tag whose history was edited therefore falls
back to a longer prefill, never to wrong keys. Weights are not checked: call `clear()` after every
optimizer step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .hf import HFEngine

if TYPE_CHECKING:
    from transformers import DynamicCache


@dataclass
class ReuseStats:
    """Prompt tokens taken from the cache versus encoded by a prefill forward."""

    reused_tokens: int = 0
    prefill_tokens: int = 0

    def reset(self) -> None:
        self.reused_tokens, self.prefill_tokens = 0, 0


@dataclass
class _Entry:
    ids: list[int]  # the tokens whose keys/values are stored, in order
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [H, L, D]


@dataclass
class _Call:
    """Bookkeeping of one generate call (the cache grows in HFEngine's decode loop)."""

    tags: list[str]
    # all three set at the prefill forward
    cache: DynamicCache | None = None  # the call's cache
    ids: torch.Tensor | None = None  # [B, T] the token of every cache column
    mask: torch.Tensor | None = None  # [B, T] 1 where the column holds a real token


@dataclass
class PrefixCachingEngine(HFEngine):
    """`HFEngine` that keeps each tagged row's keys/values between calls: up to `per_tag` entries
    a tag (the most recent ones), `max_entries` tags (least recently used dropped first).

    Same tokens as `HFEngine` (same left-padded layout, positions and sampling); only the
    prefill forward is shortened. It works by intercepting `HFEngine._forward`: the prefill is
    cut to the widest uncached suffix of the batch, and the columns before it are filled from
    the stored entries.
    """

    max_entries: int = 4096  # tags
    per_tag: int = 4  # entries of one tag: one per policy seat of a conversation, and to spare
    reuse: ReuseStats = field(default_factory=ReuseStats)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.per_tag < 1:
            raise ValueError(f"PrefixCachingEngine.per_tag must be >= 1, got {self.per_tag}")
        self._entries: OrderedDict[str, list[_Entry]] = OrderedDict()  # tag -> newest first
        self._call: _Call | None = None

    def clear(self) -> None:
        """Forget every cached prefix (required whenever the model's weights change)."""
        self._entries.clear()

    def _generate(self, requests, caps, synced):
        self._call = _Call(tags=[r.tag for r in requests])
        try:
            out = super()._generate(requests, caps, synced)
            self._store(self._call)
        finally:
            self._call = None
        return out

    def _forward(
        self,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache,
    ) -> torch.Tensor:
        call = self._call
        assert call is not None, "HFEngine forwards only inside _generate"
        if call.cache is None or call.ids is None:  # the prefill: the whole left-padded prompt batch
            call.cache, call.ids = cache, input_ids
            start = self._restore(call.tags, input_ids, attention_mask, cache)
            input_ids, position_ids = input_ids[:, start:], position_ids[:, start:]
        else:
            call.ids = torch.cat([call.ids, input_ids], dim=1)
        call.mask = attention_mask
        return super()._forward(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache
        )

    def _restore(self, tags: list[str], ids: torch.Tensor, mask: torch.Tensor, cache: DynamicCache) -> int:
        """Fill `cache` with the stored columns before the first uncached one; return its index."""
        b, width = ids.shape
        rows = [r[m.bool()].tolist() for r, m in zip(ids.cpu(), mask.cpu())]
        lens = [len(r) for r in rows]
        found = [self.lookup(tag, row) for tag, row in zip(tags, rows)]
        reuse = [n for _, n in found]
        start = width - max(n - k for n, k in zip(lens, reuse))  # [start, width) is recomputed
        self.reuse.reused_tokens += sum(max(0, n - (width - start)) for n in lens)
        self.reuse.prefill_tokens += b * (width - start)
        if start == 0:
            return 0
        # start > 0 implies every row reuses something, so any row's entry gives the shapes
        some = next(entry for entry, _ in found if entry is not None)
        for layer, (k0, v0) in enumerate(some.kv):
            shape = (b, k0.shape[0], start, k0.shape[-1])
            keys, values = k0.new_zeros(shape), v0.new_zeros(shape)  # masked columns stay zero
            for i, ((entry, _), n) in enumerate(zip(found, lens)):
                take = n - (width - start)  # this row's real tokens left of `start`
                if take > 0:
                    assert entry is not None, "a row with columns left of start reuses an entry"
                    k, v = entry.kv[layer]
                    keys[i, :, start - take :] = k[:, :take]
                    values[i, :, start - take :] = v[:, :take]
            cache.update(keys.to(ids.device), values.to(ids.device), layer)
        return start

    def lookup(self, tag: str, prompt: Sequence[int]) -> tuple[_Entry | None, int]:
        """The entry of `tag` sharing the longest prefix with `prompt` and that prefix's length
        (at most all but the prompt's last token); (None, 0) when none shares any."""
        best: tuple[_Entry | None, int] = (None, 0)
        for entry in self._entries.get(tag, []) if tag else []:
            n = common_prefix(entry.ids, prompt, len(prompt) - 1)
            if n > best[1]:
                best = (entry, n)
        return best

    def _store(self, call: _Call) -> None:
        """Keep every tagged row's real columns (prompt + all fed sampled ids) for next time."""
        if call.cache is None or call.ids is None or call.mask is None:  # no forward ran
            return
        layers = [_layer_kv(layer, n) for n, layer in enumerate(call.cache.layers)]  # each [B, H, T, D]
        for i, tag in enumerate(call.tags):
            if not tag:
                continue
            real = call.mask[i].bool().cpu()  # [T]
            kv = [(k[i][:, real].cpu(), v[i][:, real].cpu()) for k, v in layers]
            self._keep(tag, _Entry(ids=call.ids[i][real].tolist(), kv=kv))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def _keep(self, tag: str, entry: _Entry) -> None:
        """Store `entry` first among its tag's; the entries it extends (a seat's earlier turns)
        go, and the oldest beyond `per_tag`."""
        old = self._entries.pop(tag, [])
        kept = [e for e in old if e.ids != entry.ids[: len(e.ids)]]
        self._entries[tag] = [entry, *kept][: self.per_tag]  # the tag is now the most recent


def _layer_kv(layer: object, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of one attention layer of the call's cache."""
    from transformers.cache_utils import CacheLayerMixin

    if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
        raise ValueError(
            f"PrefixCachingEngine keeps attention keys/values; cache layer {index} "
            f"({type(layer).__name__}) holds none"
        )
    return layer.keys, layer.values


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the longest common prefix of `a` and `b`, at most `limit` (and at least 0)."""
    n = max(0, min(len(a), len(b), limit))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
