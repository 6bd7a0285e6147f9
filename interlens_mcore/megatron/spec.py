"""Transformer layer specs for the Llama / Qwen2 families on megatron-core.

On GPU the model uses megatron's own layers and rotary embeddings (Transformer Engine's spec
when it is installed). On CPU two of megatron's pieces need CUDA: the default
`DotProductAttention` (a global CUDA memory buffer) and the rotary embedding's `get_emb`. The
CPU spec is megatron's local spec with its core attention replaced by `SDPACoreAttention`,
which applies the rotary embedding itself and calls torch's `scaled_dot_product_attention`;
the model is then built with `position_embedding_type='none'` so megatron adds nothing.

During generation the engine may attach a key/value cache to every `SDPACoreAttention`
(kv_cache.py); the model's forward does not change.

Positions are never passed to the core attention: as in megatron's own rotary path, they are
implied by the layout, restarting at 0 for every sequence of a packed (THD) batch.
"""

from __future__ import annotations

from typing import Literal, Protocol, get_args

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import (
    HAVE_TE,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig


class AttentionCache(Protocol):
    """What SDPACoreAttention asks of the KV cache attached to it (kv_cache.KVCache)."""

    @property
    def prefilling(self) -> bool: ...

    def positions(self, cu_seqlens: torch.Tensor) -> torch.Tensor: ...

    def store(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> None: ...

    def window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def cached(self) -> torch.Tensor: ...

    def row(self, layer: int, i: int, width: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def packed_positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Position of every token of a packed batch, restarting at 0 per sequence: [T] int64."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]  # [N]
    starts = torch.repeat_interleave(cu[:-1], lengths)  # [T] start of each token's sequence
    return torch.arange(int(cu[-1]), dtype=torch.int64, device=cu.device) - starts


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] of the half-split (non-interleaved) rotary embedding.

    Computed in float32 exactly as transformers' default rotary embedding does, so the CPU
    model matches the HF checkpoint to rounding of the attention itself.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (base**exponents)  # [head_dim / 2]
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by cos, sin [T, head_dim] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos[:, None] + rotated.float() * sin[:, None]).to(x.dtype)


class SDPACoreAttention(MegatronModule):
    """Causal core attention through torch SDPA, for CPU (and GPU without Transformer Engine).

    Receives this TP rank's heads: query [s, b, np, hn] and key/value [s, b, ng, hn], or
    [t, np, hn] / [t, ng, hn] for packed THD input, where a block-diagonal causal mask keeps
    sequences apart. Grouped-query heads are expanded by SDPA (`enable_gqa`). With
    `rotary_base` set, queries and keys are rotated here (CPU); with None, megatron has
    already applied its own rotary embedding (GPU).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        cp_comm_type: str | None = None,
        softmax_scale: float | None = None,
        pg_collection=None,
        *,
        rotary_base: float | None,
    ) -> None:
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPACoreAttention supports causal attention only, got {attn_mask_type}")
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention does not support context parallelism")
        self.softmax_scale = softmax_scale
        self.rotary_base = rotary_base
        self.layer_number = layer_number
        # a kv_cache.KVCache while the engine generates (see kv_cache.py)
        self.kv_cache: AttentionCache | None = None

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.rotary_base is None:
            return x
        cos, sin = rope_cos_sin(positions, x.shape[-1], self.rotary_base)
        return apply_rope(x, cos, sin)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [b, np, s, hn], k/v [b, ng, s, hn] -> [b, np, s, hn]
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.config.attention_dropout if self.training else 0.0,
            is_causal=True,
            scale=self.softmax_scale,
            enable_gqa=True,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None:
            raise ValueError(
                "SDPACoreAttention is causal only: pass attention_mask=None (pack instead of padding)"
            )
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        packed = packed_seq_params if thd else None
        if self.kv_cache is not None:
            assert packed is not None, "the engine feeds packed input when a KV cache is attached"
            return self._forward_cached(self.kv_cache, query, key, value, packed.cu_seqlens_q)
        if packed is not None:
            return self._forward_packed(query, key, value, packed.cu_seqlens_q)
        s, b, heads, hn = query.shape
        positions = torch.arange(s, dtype=torch.int64, device=query.device)
        q = self._rope(query.reshape(s, b * heads, hn), positions).reshape(query.shape)
        k = self._rope(key.reshape(s, -1, hn), positions).reshape(key.shape)
        out = self._attend(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3))
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * hn)  # [s, b, np * hn]

    def _forward_packed(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        positions = packed_positions(cu_seqlens)
        q, k = self._rope(query, positions), self._rope(key, positions)  # [t, np|ng, hn]
        return self._attend_packed(q, k, value, cu_seqlens)

    def _forward_cached(
        self,
        cache: AttentionCache,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seqlens: torch.Tensor,
    ) -> torch.Tensor:
        positions = cache.positions(cu_seqlens)  # [t] continuing each row's cached tokens
        q, k = self._rope(query, positions), self._rope(key, positions)
        cache.store(self.layer_number, k, value, cu_seqlens)
        if cache.prefilling:
            cached = cache.cached()  # [A] tokens an earlier call left in each row
            if not bool(cached.any()):  # whole prompts, nothing cached before them
                return self._attend_packed(q, k, value, cu_seqlens)
            return self._attend_continued(cache, q, cu_seqlens, cached)
        keys, values, mask = cache.window(self.layer_number)  # [A, ng, L, hn], [A, 1, 1, L]
        out = F.scaled_dot_product_attention(
            q[:, :, None], keys, values, attn_mask=mask, scale=self.softmax_scale, enable_gqa=True
        )  # [A, np, 1, hn]: one new token per row
        return out.reshape(out.shape[0], -1)  # [A, np * hn]

    def _attend_continued(
        self, cache: AttentionCache, q: torch.Tensor, cu_seqlens: torch.Tensor, cached: torch.Tensor
    ) -> torch.Tensor:
        """Prefill of rows that continue cached tokens: fed token j of a row with c cached ones
        attends to the row's positions 0 .. c + j (the causal mask aligned at the bottom right)."""
        bounds = cu_seqlens.tolist()
        outs = []
        for i, (start, end, c) in enumerate(zip(bounds[:-1], bounds[1:], cached.tolist(), strict=True)):
            n = end - start
            keys, values = cache.row(self.layer_number, i, c + n)  # [ng, c + n, hn]
            seen = c + torch.arange(n, device=q.device)  # [n] the last position each fed token sees
            mask = torch.arange(c + n, device=q.device)[None, :] <= seen[:, None]
            out = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1)[None],
                keys[None],
                values[None],
                attn_mask=mask,
                scale=self.softmax_scale,
                enable_gqa=True,
            )  # [1, np, n, hn]
            outs.append(out[0].transpose(0, 1))  # [n, np, hn]
        out = torch.cat(outs, dim=0)
        return out.reshape(out.shape[0], -1)  # [t, np * hn]

    def _attend_packed(
        self, q: torch.Tensor, k: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        bounds = cu_seqlens.tolist()
        outs = []
        # one SDPA call per sequence: sum of L_i^2 work instead of a [t, t] block mask
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            qs, ks, vs = (x[start:end].transpose(0, 1)[None] for x in (q, k, value))
            outs.append(self._attend(qs, ks, vs)[0].transpose(0, 1))  # [L, np, hn]
        out = torch.cat(outs, dim=0)
        return out.reshape(out.shape[0], -1)  # [t, np * hn]


SpecKind = Literal["transformer_engine", "local", "sdpa_cpu"]


def choose_spec(*, cuda: bool, have_te: bool = HAVE_TE) -> SpecKind:
    """Which layer spec a model gets where it runs.

    - "transformer_engine": megatron's TE spec (fused norms and linears, TE attention, THD
      packed sequences, megatron's RoPE). On GPU when TE is installed.
    - "local": megatron's local layers and megatron's RoPE, with `SDPACoreAttention` as the
      core attention: megatron's own local `DotProductAttention` refuses packed (THD) input,
      which training and the engine feed. On GPU without TE.
    - "sdpa_cpu": the local layers with `SDPACoreAttention` applying RoPE itself (megatron's
      rotary embedding needs CUDA). On CPU.
    """
    if not cuda:
        return "sdpa_cpu"
    return "transformer_engine" if have_te else "local"


def layer_spec(kind: SpecKind, *, rotary_base: float) -> ModuleSpec:
    """The transformer layer spec of `kind` (see `choose_spec`)."""
    if kind == "transformer_engine":
        if not HAVE_TE:
            raise ValueError("layer spec 'transformer_engine' needs transformer_engine installed")
        return get_gpt_layer_with_transformer_engine_spec()
    if kind not in ("local", "sdpa_cpu"):
        raise ValueError(f"layer spec must be one of {get_args(SpecKind)}, got {kind!r}")
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=SDPACoreAttention,
        params={"rotary_base": rotary_base if kind == "sdpa_cpu" else None},
    )
    return spec
