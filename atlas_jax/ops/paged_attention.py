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
dequantize, logits and softmax in float32 (HIGHEST matmul precision). The "pallas" one runs the
kernels of ``pallas_kernels.paged_attention`` (GQA-packed, KV dequantized in registers, in
interpret mode without a GPU): the split-K decode kernel for decode steps (``seq_lens`` given:
the S queries are the last S positions of each sequence) and the flash-attention prefill kernel
for everything else (queries at any ``q_pos``: a prompt, or a chunk after a cached prefix).
Both need head_dim in 64/128/256/512 and a power-of-two page size: "pallas" raises
NotImplementedError otherwise, and "auto" (Pallas on a GPU) falls back to the reference.

The KV write (``PagedKVCache.write``: quantize + slot-mapping scatter) stays an XLA fusion in
front of the kernel, not fused into it: it moves the chunk's K/V once (``S * Hk * D`` elements,
tens of microseconds for a 16k-token prompt) against milliseconds of prefill attention, and for
decode a few tokens' worth; ``benchmarks/paged_attention.py --prefill`` times it beside the
kernel.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from atlas_jax.config import Backend, GmmKernel, KernelConfig
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


def pallas_unsupported(q: jax.Array, cache: PagedKVCache) -> str | None:
    """Why the Pallas kernels cannot run this call (None: they can)."""
    from pallas_kernels.paged_attention import HEAD_DIMS

    d, p = q.shape[-1], cache.page_size
    if d not in HEAD_DIMS:
        return f"head_dim {d}: the Pallas kernels tile D in {HEAD_DIMS}"
    if p & (p - 1):
        return f"page_size {p}: the Pallas kernels need a power of two"
    from pallas_kernels._offsets import int32_offsets_overflow

    # 1-byte pages of that size go in through their uint16 pair view; NVFP4's block scales
    # have none
    for name, a in _pages(cache).items():
        if (name.endswith("_scale") and hasattr(a, "shape")
                and int32_offsets_overflow(a.shape, a.dtype)):
            return (f"{name} {tuple(a.shape)} {a.dtype}: a 1-byte scale array of more than "
                    "2**31 elements and at most 2**32 bytes, which Pallas' Triton lowering "
                    "would index with overflowing int32 offsets (size the cache so that it "
                    "stays below 2 GiB or above 4 GiB)")
    return None


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
    unsupported = pallas_unsupported(q, cache)
    opts = dict(scale=scale, sliding_window=sliding_window, logit_softcap=logit_softcap,
                sinks=sinks)
    match resolve_backend(op, backend, unsupported=unsupported):
        case Backend.XLA:
            return paged_attention_reference(q, cache, block_tables, q_pos, **opts)
        case Backend.PALLAS if unsupported is not None:
            raise NotImplementedError(f"paged_attention: {unsupported}; use "
                                      "KernelConfig(paged_attention='auto' or 'xla')")
        case Backend.PALLAS if seq_lens is None:
            return paged_prefill_pallas(q, cache, block_tables, q_pos, **opts, kernels=kernels)
        case Backend.PALLAS:
            return paged_attention_pallas(q, cache, block_tables, seq_lens, **opts,
                                          kernels=kernels)


def _pages(cache: PagedKVCache) -> dict:
    """The cache's arrays as the kernels take them (scales as they are stored)."""
    return dict(k_pages=cache.k.data, v_pages=cache.v.data, kv_dtype=cache.dtype.value,
                k_scale=cache.k.scale, v_scale=cache.v.scale,
                k_global_scale=cache.k.global_scale, v_global_scale=cache.v.global_scale)


def _call_kernel(kernel, q, cache, block_tables, positions, **kw) -> jax.Array:
    """``paged_decode`` (positions: seq_lens) or ``paged_prefill`` (q_pos) over the cache's
    pages, f32 out, in interpret mode without a GPU."""
    pages = _pages(cache)
    return kernel(q, pages.pop("k_pages"), pages.pop("v_pages"), block_tables.astype(jnp.int32),
                  positions.astype(jnp.int32), **pages, **kw, out_dtype=jnp.float32,
                  interpret=interpret_mode())


def _use_mosaic(q, cache: PagedKVCache, logit_softcap, k: KernelConfig) -> bool:
    """``KernelConfig.attn_decode_kernel`` resolved: "mosaic" (NotImplementedError naming the
    reason where the Mosaic GPU kernel cannot run), "triton", or "auto": Mosaic GPU on an
    sm_90 GPU for the FP8 caches it supports with at most ``AUTO_MAX_ROWS`` query rows a kv
    head (``Q * Hq / Hk``; past it the kernel spills), unless ``attn_block_pages`` (a Triton
    tunable) is set. On the H200 it measured 1.08-1.45x the Triton FP8 kernel (B 1..32,
    4k..32k, 8 rows; benchmarks/RESULTS.md, session 11)."""
    from pallas_kernels.paged_attention.mosaic import AUTO_MAX_ROWS, unsupported_reason

    _, nq, hq, d = q.shape
    hk = cache.k.data.shape[2]
    rows = nq * hq // hk
    reason = unsupported_reason(cache.dtype.value, d, cache.k.data.shape[1], rows,
                                logit_softcap)
    match k.attn_decode_kernel:
        case GmmKernel.TRITON:
            return False
        case GmmKernel.MOSAIC:
            if interpret_mode():
                reason = "the Mosaic GPU kernel runs on an sm_90 GPU only (no interpret mode)"
            if reason is not None:
                raise NotImplementedError(f"paged_attention: {reason}; use "
                                          "KernelConfig(attn_decode_kernel='auto' or 'triton')")
            return True
        case GmmKernel.AUTO:
            from pallas_kernels.grouped_matmul import device_compute_capability

            return (reason is None and rows <= AUTO_MAX_ROWS and not interpret_mode()
                    and device_compute_capability() == (9, 0) and k.attn_block_pages is None)


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
    """The decode kernel over the cache's pages: the Triton split-K kernel, or for FP8 pages
    the Mosaic GPU one (``KernelConfig.attn_decode_kernel``, ``_use_mosaic``)."""
    from pallas_kernels.paged_attention import DecodeConfig, paged_decode, paged_decode_mosaic

    k = kernels or KernelConfig()
    if _use_mosaic(q, cache, logit_softcap, k):
        pages = _pages(cache)
        return paged_decode_mosaic(q, pages["k_pages"], pages["v_pages"],
                                   block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32),
                                   k_scale=pages["k_scale"], v_scale=pages["v_scale"],
                                   scale=scale, sliding_window=sliding_window, sinks=sinks,
                                   num_splits=k.attn_num_splits, out_dtype=jnp.float32)
    config = None
    if k.attn_num_splits is not None or k.attn_block_pages is not None:
        config = DecodeConfig(pages_per_step=k.attn_block_pages or 8,
                              num_splits=k.attn_num_splits or 1)
    if not k.attn_gqa_pack:
        raise NotImplementedError("paged_attention: the Pallas decode kernel always packs the "
                                  "query heads of a KV head (attn_gqa_pack=False is not built)")
    return _call_kernel(paged_decode, q, cache, block_tables, seq_lens, config=config,
                        scale=scale, sliding_window=sliding_window,
                        logit_softcap=logit_softcap, sinks=sinks)


def paged_prefill_pallas(
    q: jax.Array,  # [B, S, Hq, D]
    cache: PagedKVCache,
    block_tables: jax.Array,  # [B, Pt] int32
    q_pos: jax.Array,  # [B, S] int32, -1: padding
    *,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,
    kernels: KernelConfig | None = None,
) -> jax.Array:  # [B, S, Hq, D] float32
    """The prefill kernel over the cache's pages. ``attn_block_pages`` sets its pages per
    step, ``attn_gqa_pack=False`` one query head per program; the rest is its heuristic's."""
    from pallas_kernels.paged_attention import (
        choose_prefill_config,
        device_sm_count,
        paged_prefill,
    )

    k = kernels or KernelConfig()
    b, s, hq, d = q.shape
    g = hq // cache.num_kv_heads
    config = choose_prefill_config(max(b, 1), cache.num_kv_heads, g, max(s, 1),
                                   max(block_tables.shape[1], 1), cache.page_size, d,
                                   cache.dtype.value, device_sm_count())
    if k.attn_block_pages is not None:
        config = dataclasses.replace(config, pages_per_step=k.attn_block_pages)
    if not k.attn_gqa_pack:
        config = dataclasses.replace(config, q_heads_per_program=1,
                                     block_q=min(128, config.rows(g)))
    return _call_kernel(paged_prefill, q, cache, block_tables, q_pos, config=config,
                        scale=scale, sliding_window=sliding_window,
                        logit_softcap=logit_softcap, sinks=sinks)
