"""Plain-jnp references of paged-attention prefill and decode (float32 throughout), what the
kernel tests compare with.

Query ``i`` of the ``Q`` new tokens of sequence ``b`` sits at position ``seq_lens[b] - Q + i``
and sees the cached keys at positions ``t <= `` its own (causal among the new tokens), and with
a sliding window ``W`` only ``t > pos - W``. Logits are ``scale * q . k`` (then
``c * tanh(l / c)`` with a softcap ``c``); optional per-head sink logits (gpt-oss) join the
softmax denominator only. A query that sees no key (and has no sink) outputs 0.

Prefill generalizes this to queries at arbitrary positions ``q_pos [B, S]`` (``-1``: a padding
query, output 0); decode is prefill with ``q_pos[b] = seq_lens[b] - Q + arange(Q)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention.config import NVFP4_GROUP, KVDtype

_HIGHEST = jax.lax.Precision.HIGHEST

# E2M1 code -> value (bit 3 is the sign).
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)


def dequantize_pages(
    data: jax.Array,  # [*L, K, D] f32/bf16/e4m3 | [*L, K, D//2] u8 (NVFP4)
    kv_dtype: KVDtype | str,
    scale: jax.Array | None = None,  # FP8 [*L, K] f32 | NVFP4 [*L, K, D//16] e4m3
    global_scale: jax.Array | None = None,  # NVFP4 [*L, K] f32
) -> jax.Array:  # [*L, K, D] f32
    """Dequantized K or V values in float32."""
    match KVDtype.coerce(kv_dtype):
        case KVDtype.FLOAT32 | KVDtype.BF16:
            return data.astype(jnp.float32)
        case KVDtype.FP8:
            return data.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]
        case KVDtype.NVFP4:
            codes = data.astype(jnp.int32)
            pairs = jnp.stack([codes & 0xF, codes >> 4], axis=-1)  # low nibble = even d
            vals = jnp.asarray(E2M1_VALUES)[pairs].reshape(*data.shape[:-1], -1)  # [*L, K, D]
            *lead, d = vals.shape
            s = scale.astype(jnp.float32)  # [*L, K, D//16]
            vals = vals.reshape(*lead, d // NVFP4_GROUP, NVFP4_GROUP) * s[..., None]
            return vals.reshape(*lead, d) * global_scale.astype(jnp.float32)[..., None]


def paged_prefill_reference(
    q: jax.Array,  # [B, S, Hq, D]
    k_pages: jax.Array,  # [N, P, K, D] | NVFP4 [N, P, K, D//2] u8
    v_pages: jax.Array,  # as k_pages
    block_tables: jax.Array,  # [B, Pt] int32
    q_pos: jax.Array,  # [B, S] int32 position of each query, < 0: padding
    *,
    kv_dtype: KVDtype | str,
    scale: float,
    k_scale: jax.Array | None = None,  # FP8 [N, P, K] f32 | NVFP4 [N, P, K, D//16] e4m3
    v_scale: jax.Array | None = None,
    k_global_scale: jax.Array | None = None,  # NVFP4 [N, P, K] f32
    v_global_scale: jax.Array | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,  # [Hq] logits
) -> jax.Array:  # [B, S, Hq, D] float32
    """Attention of queries at arbitrary positions ``q_pos`` over each sequence's pages.

    Query ``(b, s)`` sees the keys ``t <= q_pos[b, s]`` (and ``t > q_pos - W`` with a window
    ``W``); a negative ``q_pos`` marks a padding query, which sees nothing (output 0). Only
    positions some query of the sequence sees are read: other page-table entries and page rows
    may hold anything (they are zeroed before use).
    """
    kv_dtype = KVDtype.coerce(kv_dtype)
    b, nq, hq, d = q.shape
    n, p, hk = k_pages.shape[:3]
    pt = block_tables.shape[1]
    g = hq // hk
    ids = jnp.clip(block_tables, 0, n - 1)  # [B, Pt]; only entries in use matter

    def gather(data, s, gs):  # -> [B, L, K, D] f32, L = Pt * P
        take = lambda a: None if a is None else jnp.take(a, ids, axis=0)  # noqa: E731
        x = dequantize_pages(take(data), kv_dtype, take(s), take(gs))  # [B, Pt, P, K, D]
        return x.reshape(b, pt * p, hk, d)

    t = jnp.arange(pt * p)  # [L] key positions
    qp = q_pos.astype(jnp.int32)[:, :, None]  # [B, S, 1]
    visible = (t[None, None, :] <= qp) & (qp >= 0)  # [B, S, L]
    if sliding_window is not None:
        visible &= t[None, None, :] > qp - sliding_window
    seen = visible.any(axis=1)[:, :, None, None]  # [B, L, 1, 1]: read by some query
    k = jnp.where(seen, gather(k_pages, k_scale, k_global_scale), 0.0)
    v = jnp.where(seen, gather(v_pages, v_scale, v_global_scale), 0.0)

    qg = q.astype(jnp.float32).reshape(b, nq, hk, g, d)  # [B, S, K, G, D]
    logits = jnp.einsum("bqkgd,blkd->bkgql", qg, k, precision=_HIGHEST) * scale
    if logit_softcap is not None:
        logits = logit_softcap * jnp.tanh(logits / logit_softcap)
    visible = visible[:, None, None]  # [B, 1, 1, S, L]
    m = jnp.max(jnp.where(visible, logits, -jnp.inf), axis=-1)  # [B, K, G, S]
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(hk, g)[None, :, :, None]  # [1, K, G, 1]
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.where(visible, jnp.exp(logits - m[..., None]), 0.0)  # [B, K, G, S, L]
    denom = w.sum(-1)  # [B, K, G, S]
    if sinks is not None:
        denom = denom + jnp.exp(sink - m)
    out = jnp.einsum("bkgql,blkd->bqkgd", w, v, precision=_HIGHEST)  # [B, S, K, G, D]
    denom = jnp.moveaxis(denom, -1, 1)[..., None]  # [B, S, K, G, 1]
    out = jnp.where(denom > 0, out / jnp.where(denom > 0, denom, 1.0), 0.0)
    return out.reshape(b, nq, hq, d)


def paged_decode_reference(
    q: jax.Array,  # [B, Q, Hq, D]
    k_pages: jax.Array,  # [N, P, K, D] | NVFP4 [N, P, K, D//2] u8
    v_pages: jax.Array,  # as k_pages
    block_tables: jax.Array,  # [B, Pmax] int32
    seq_lens: jax.Array,  # [B] int32, cached tokens + the Q new ones
    **kwargs,  # as paged_prefill_reference
) -> jax.Array:  # [B, Q, Hq, D] float32
    """Attention of the ``Q`` new tokens over each sequence's cached pages (module docstring):
    ``paged_prefill_reference`` with ``q_pos[b] = seq_lens[b] - Q + arange(Q)``."""
    nq = q.shape[1]
    q_pos = seq_lens.astype(jnp.int32)[:, None] - nq + jnp.arange(nq, dtype=jnp.int32)[None, :]
    return paged_prefill_reference(q, k_pages, v_pages, block_tables, q_pos, **kwargs)
