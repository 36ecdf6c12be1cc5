"""Paged attention, the kernel boundary of the attention layer.

``out[b, s, h] = sum_t p[b, h, s, t] * V[b, t, h // G]`` over the cache positions ``t`` that
query ``(b, s)`` sees, with ``p = softmax_t(softcap(scale * q . K[b, t, h // G]))`` (G = query
heads per kv head) and, with sinks, one extra per-head logit in the softmax denominator
(gpt-oss). Query ``(b, s)`` sits at position ``q_pos[b, s]`` and sees ``t <= q_pos[b, s]``
(causal, which covers a cached prefix and the causal chunk alike) and, with a sliding window W,
``q_pos[b, s] - t < W`` (transformers' ``sliding_window_overlay``). ``q_pos = -1`` marks a
padding query: it sees nothing and its output is 0 (as is any row with no visible key and no
sink). Slots no query sees (unused table entries, positions past the queries) may hold anything,
NaN included: they never reach the output.

The "xla" implementation is the plain-jnp reference: gather each sequence's pages,
dequantize, logits and softmax in float32 (HIGHEST matmul precision). The "pallas" one is the
split-K decode kernel of ``pallas_kernels.paged_attention`` (GQA-packed, KV dequantized in
registers); it serves decode steps (``seq_lens`` given: the S queries are the last S positions
of each sequence). There is no Pallas prefill kernel yet: "pallas" raises for a prefill call
and "auto" uses the reference for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from atlas_jax.config import Backend, KernelConfig
from atlas_jax.ops._dispatch import interpret_mode, resolve_backend

if TYPE_CHECKING:
    from atlas_jax.attention.kv_cache import PagedKVCache

_HIGHEST = jax.lax.Precision.HIGHEST


def paged_attention_reference(
    q: jax.Array,  # [B, S, Hq, D]
    cache: PagedKVCache,  # pages [N, P, Hk, D]
    block_tables: jax.Array,  # [B, Pt] int32
    q_pos: jax.Array,  # [B, S] int32 position of each query, -1: padding
    *,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,  # [Hq]
) -> jax.Array:  # [B, S, Hq, D] float32
    k, v = cache.gather(block_tables)  # [B, L, Hk, D] f32, L = Pt * P
    b, s, hq, d = q.shape
    hk = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, s, hk, hq // hk, d)  # [B, S, Hk, G, D]
    logits = jnp.einsum("bskgd,blkd->bkgsl", qg, k, precision=_HIGHEST) * scale
    if logit_softcap is not None:
        logits = logit_softcap * jnp.tanh(logits / logit_softcap)
    t = jnp.arange(k.shape[1])  # [L]
    qp = q_pos[:, :, None]  # [B, S, 1]
    visible = (t <= qp) & (qp >= 0)  # [B, S, L]
    if sliding_window is not None:
        visible &= qp - t < sliding_window
    visible = visible[:, None, None]  # [B, 1, 1, S, L]
    m = jnp.max(jnp.where(visible, logits, -jnp.inf), axis=-1)  # [B, Hk, G, S]
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(hk, hq // hk)[None, :, :, None]  # [1,Hk,G,1]
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(visible, jnp.exp(logits - m[..., None]), 0.0)  # [B, Hk, G, S, L]
    v = jnp.where(visible.any(axis=3)[:, 0, 0, :, None, None], v, 0.0)  # unseen slots: any junk
    denom = p.sum(-1)  # [B, Hk, G, S]
    if sinks is not None:
        denom = denom + jnp.exp(sink - m)
    out = jnp.einsum("bkgsl,blkd->bskgd", p, v, precision=_HIGHEST)  # [B, S, Hk, G, D]
    denom = jnp.moveaxis(denom, -1, 1)[..., None]  # [B, S, Hk, G, 1]
    out = jnp.where(denom > 0, out / jnp.where(denom > 0, denom, 1.0), 0.0)
    return out.reshape(b, s, hq, d)


def _check(q, cache, block_tables, q_pos, sinks) -> None:
    if q.ndim != 4:
        raise ValueError(f"paged_attention: q must be [B, S, Hq, D], got shape {q.shape}")
    b, s, hq, d = q.shape
    if d != cache.head_dim or hq % cache.num_kv_heads:
        raise ValueError(f"paged_attention: q has {hq} heads of dim {d}; the cache holds "
                         f"{cache.num_kv_heads} kv heads of dim {cache.head_dim} (kv heads must "
                         "divide query heads)")
    if block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ValueError(f"paged_attention: block_tables must be [{b}, Pt], "
                         f"got {block_tables.shape}")
    if q_pos.shape != (b, s):
        raise ValueError(f"paged_attention: q_pos must be [{b}, {s}], got {q_pos.shape}")
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"paged_attention: sinks must be [{hq}], got {sinks.shape}")


def paged_attention(
    q: jax.Array,  # [B, S, Hq, D]
    cache: PagedKVCache,
    block_tables: jax.Array,  # [B, Pt] int32
    q_pos: jax.Array,  # [B, S] int32, -1: padding
    *,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,  # [Hq]
    seq_lens: jax.Array | None = None,  # [B] decode: q_pos[b] = seq_lens[b] - S + arange(S)
    kernels: KernelConfig | None = None,
) -> jax.Array:  # [B, S, Hq, D] float32
    """Attention of ``q`` over the paged cache (semantics in the module docstring)."""
    _check(q, cache, block_tables, q_pos, sinks)
    backend = (kernels or KernelConfig()).paged_attention
    op = "paged_attention decode" if seq_lens is not None else "paged_attention prefill"
    match resolve_backend(op, backend, pallas_available=seq_lens is not None):
        case Backend.XLA:
            return paged_attention_reference(
                q, cache, block_tables, q_pos, scale=scale, sliding_window=sliding_window,
                logit_softcap=logit_softcap, sinks=sinks)
        case Backend.PALLAS if seq_lens is None:
            raise NotImplementedError(
                "paged_attention: no Pallas prefill kernel yet (the Pallas kernel serves decode "
                "steps); use KernelConfig(paged_attention='auto' or 'xla') for prefill")
        case Backend.PALLAS:
            return paged_attention_pallas(
                q, cache, block_tables, seq_lens, scale=scale, sliding_window=sliding_window,
                logit_softcap=logit_softcap, sinks=sinks, kernels=kernels)


def paged_attention_pallas(
    q: jax.Array,  # [B, Q, Hq, D]
    cache: PagedKVCache,
    block_tables: jax.Array,  # [B, Pt] int32
    seq_lens: jax.Array,  # [B] int32: cached tokens plus the Q new ones
    *,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,
    kernels: KernelConfig | None = None,
) -> jax.Array:  # [B, Q, Hq, D] float32
    """The decode kernel over the cache's pages (its scales as they are stored)."""
    from pallas_kernels.paged_attention import DecodeConfig, paged_decode

    k = kernels or KernelConfig()
    config = None
    if k.attn_num_splits is not None or k.attn_block_pages is not None:
        config = DecodeConfig(pages_per_step=k.attn_block_pages or 8,
                              num_splits=k.attn_num_splits or 1)
    if not k.attn_gqa_pack:
        raise NotImplementedError("paged_attention: the Pallas decode kernel always packs the "
                                  "query heads of a KV head (attn_gqa_pack=False is not built)")
    return paged_decode(
        q, cache.k.data, cache.v.data, block_tables.astype(jnp.int32),
        seq_lens.astype(jnp.int32), kv_dtype=cache.dtype.value,
        k_scale=cache.k.scale, v_scale=cache.v.scale,
        k_global_scale=cache.k.global_scale, v_global_scale=cache.v.global_scale,
        scale=scale, sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks,
        config=config, out_dtype=jnp.float32, interpret=interpret_mode())
