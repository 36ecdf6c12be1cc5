"""The Qwen3-family attention layer over a paged KV cache: ``prefill`` and ``decode``.

One step, for ``x [B, S, H]`` whose token ``s`` of sequence ``b`` sits at position
``start[b] + s``:

1. q, k, v projections (+ biases); q_proj may also yield an output gate (``q_proj_rows``);
2. per-head RMSNorm of q and k over head_dim (Qwen3 QK-norm), BEFORE RoPE;
3. RoPE on q and k (neox / GPT-J / mrope, partial, YaRN);
4. k, v written into the cache through the slot mapping (scatter);
5. paged attention of q over the cache: the cached prefix plus the causal part of this chunk;
6. output gate (``* sigmoid(gate)`` elementwise, or one sigmoid/softplus scalar per head), then
   o_proj (+ bias).

What is checked where: shapes and dtypes raise ValueError / TypeError at trace time. Values
(block-table page ids, positions against the table's capacity, ``seq_lens >= Q``, pages shared
between a writer and another sequence, ``lengths``) are checked by
``kv_cache.check_tables`` on the host: at once for concrete arrays, from a
``jax.debug.callback`` under ``jax.jit``, where the ValueError surfaces as a runtime error
(``JaxRuntimeError``) carrying its message when the result is computed. That callback costs a
device-to-host copy of the block tables each step (a later kernel issue may gate it). Not
checked: table entries a sequence does not use (ignored, may hold anything), RoPE ``positions``
values, non-finite inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from atlas_jax._checks import host_check
from atlas_jax.attention.kv_cache import PagedKVCache, check_tables
from atlas_jax.attention.norm import rms_norm
from atlas_jax.attention.params import AttentionParams
from atlas_jax.attention.rope import apply_rope, rope_cos_sin
from atlas_jax.config import KernelConfig, OutputGate, RopeStyle
from atlas_jax.ops.grouped_matmul import compute_dtype
from atlas_jax.ops.paged_attention import paged_attention
from atlas_jax.quant import QTensor, dequantize

MAX_DECODE_TOKENS = 4  # decode's Q: one token, or up to 3 MTP drafts verified with it


# ---- the layer math, each a small pure function -------------------------------------------------


def linear(x: jax.Array, w: QTensor, bias: jax.Array | None) -> jax.Array:
    """``x @ w^T (+ bias)``, float32 out; f32 inputs stay f32, others run in bf16.
    # [..., K], [N, K] -> [..., N]"""
    dtype = compute_dtype(x)
    y = jnp.einsum("...k,nk->...n", x.astype(dtype), dequantize(w, dtype=dtype),
                   preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    return y if bias is None else y + bias.astype(jnp.float32)


def project_qkv(params: AttentionParams, x: jax.Array):
    """``x [B, S, H]`` -> q ``[B, S, Hq, D]``, k, v ``[B, S, Hk, D]``, gate ``[B, S, Hq, D]``
    (elementwise) / ``[B, S, Hq, 1]`` (head-wise) / None; all float32."""
    cfg = params.config
    b, s, _ = x.shape
    d = cfg.head_dim
    q = linear(x, params.q_proj, params.q_bias).reshape(b, s, cfg.num_heads, -1)
    k = linear(x, params.k_proj, params.k_bias).reshape(b, s, cfg.num_kv_heads, d)
    v = linear(x, params.v_proj, params.v_bias).reshape(b, s, cfg.num_kv_heads, d)
    gate = None if cfg.output_gate is OutputGate.NONE else q[..., d:]  # per head [q_h | gate_h]
    return q[..., :d], k, v, gate


def qk_norm_rope(params: AttentionParams, q: jax.Array, k: jax.Array, positions: jax.Array):
    """QK-norm (per head, over head_dim) then RoPE. ``positions [B, S]`` or ``[3, B, S]``."""
    cfg = params.config
    if cfg.qk_norm:
        q = rms_norm(q, params.q_norm, cfg.rms_norm_eps, cfg.norm_style)
        k = rms_norm(k, params.k_norm, cfg.rms_norm_eps, cfg.norm_style)
    cos, sin = rope_cos_sin(cfg.rope, cfg.head_dim, positions)  # [B, S, R/2]
    return apply_rope(q, cos, sin, cfg.rope.style), apply_rope(k, cos, sin, cfg.rope.style)


def apply_output_gate(attn: jax.Array, gate: jax.Array | None, kind: OutputGate) -> jax.Array:
    """``attn [B, S, Hq, D]`` times the activated gate (``[B, S, Hq, D]`` or ``[B, S, Hq, 1]``)."""
    match kind:
        case OutputGate.NONE:
            return attn
        case OutputGate.ELEMENTWISE | OutputGate.HEADWISE_SIGMOID:
            return attn * jax.nn.sigmoid(gate)
        case OutputGate.HEADWISE_SOFTPLUS:
            return attn * jax.nn.softplus(gate)


def attention_step(
    params: AttentionParams,
    x: jax.Array,  # [B, S, H]
    cache: PagedKVCache,
    block_tables: jax.Array,  # [B, Pt]
    start: jax.Array,  # [B] position of x[:, 0]
    n_valid: jax.Array,  # [B] tokens of each row that are real (the rest is padding)
    positions: jax.Array | None,  # RoPE positions [B, S] / [3, B, S] (None: start + s)
    kernels: KernelConfig | None,
    decode: bool = False,  # every row holds S real tokens ending at start + S (a decode step)
) -> tuple[jax.Array, PagedKVCache]:
    """Steps 1-6 of the module docstring, no checks. Padding rows give 0 and write nothing."""
    cfg = params.config
    b, s, _ = x.shape
    offs = jnp.arange(s, dtype=jnp.int32)
    valid = offs < n_valid[:, None]  # [B, S]
    q_pos = jnp.where(valid, start[:, None] + offs, -1).astype(jnp.int32)  # [B, S]
    q, k, v, gate = project_qkv(params, x)
    q, k = qk_norm_rope(params, q, k, jnp.maximum(q_pos, 0) if positions is None else positions)
    slots = cache.slot_mapping(block_tables, q_pos).reshape(-1)  # [B*S], -1: skip
    kh = cfg.num_kv_heads
    cache = cache.write(slots, k.reshape(b * s, kh, -1), v.reshape(b * s, kh, -1))
    attn = paged_attention(q, cache, block_tables, q_pos, scale=cfg.softmax_scale,
                           sliding_window=cfg.sliding_window, logit_softcap=cfg.logit_softcap,
                           sinks=params.sinks, seq_lens=start + s if decode else None,
                           kernels=kernels)  # [B, S, Hq, D] f32
    attn = apply_output_gate(attn, gate, cfg.output_gate).reshape(b, s, -1)
    y = linear(attn.astype(compute_dtype(x)), params.o_proj, params.o_bias)  # [B, S, H]
    return jnp.where(valid[..., None], y, 0.0).astype(x.dtype), cache


# One compiled program per (config, shapes, cache dtype, kernels); inlined under an outer jit.
_attention_step = jax.jit(attention_step, static_argnames=("kernels", "decode"))


# ---- the public entry points --------------------------------------------------------------------


def prefill(
    params: AttentionParams,
    x: jax.Array,  # [B, S, H]
    cache: PagedKVCache,
    block_tables: jax.Array,  # [B, Pt] int32 page ids
    start_pos: jax.Array,  # [B] int: position of x[:, 0] (0: fresh prompt; > 0: after a prefix)
    *,
    kernels: KernelConfig | None = None,
    lengths: jax.Array | None = None,  # [B] int: real tokens per row (None: all S)
    positions: jax.Array | None = None,  # RoPE positions [B, S] or [3, B, S] (mrope)
) -> tuple[jax.Array, PagedKVCache]:  # y [B, S, H] in x.dtype, the updated cache
    """A prompt chunk: writes its K/V at positions ``start_pos + s`` and attends to the cached
    prefix ``[0, start_pos)`` plus the chunk causally. Rows past ``lengths[b]`` are padding:
    they write nothing and come out as 0."""
    b, s = _check_call("prefill", params, x, cache, block_tables, start_pos, "start_pos")
    n_valid = jnp.full((b,), s, jnp.int32) if lengths is None else _int_vector(
        "prefill", "lengths", lengths, b)
    start = jnp.asarray(start_pos).astype(jnp.int32)
    _check_positions("prefill", params, positions, b, s)
    if lengths is not None:
        host_check(functools.partial(_check_lengths, s=s), n_valid)
    _check_tables(cache, block_tables, start, start + n_valid, "start_pos")
    if b == 0 or s == 0:
        return jnp.zeros_like(x), cache
    return _attention_step(params, x, cache, block_tables, start, n_valid, positions,
                           kernels=kernels)


def decode(
    params: AttentionParams,
    x: jax.Array,  # [B, Q, H], Q in 1..4
    cache: PagedKVCache,
    block_tables: jax.Array,  # [B, Pt] int32 page ids
    seq_lens: jax.Array,  # [B] int: cached tokens plus these Q
    *,
    kernels: KernelConfig | None = None,
    positions: jax.Array | None = None,  # RoPE positions [B, Q] or [3, B, Q] (mrope)
) -> tuple[jax.Array, PagedKVCache]:  # y [B, Q, H] in x.dtype, the updated cache
    """Q new tokens per sequence at positions ``seq_lens - Q .. seq_lens - 1``, causal among
    themselves (MTP verify), each sequence with its own length."""
    b, q = _check_call("decode", params, x, cache, block_tables, seq_lens, "seq_lens")
    if not 1 <= q <= MAX_DECODE_TOKENS:
        raise ValueError(f"decode: x must hold Q in 1..{MAX_DECODE_TOKENS} new tokens per "
                         f"sequence ([B, Q, H]), got Q={q}")
    seq = jnp.asarray(seq_lens).astype(jnp.int32)
    _check_positions("decode", params, positions, b, q)
    host_check(functools.partial(_check_seq_lens, q=q), seq)
    _check_tables(cache, block_tables, seq - q, seq, "seq_lens")
    if b == 0:
        return jnp.zeros_like(x), cache
    return _attention_step(params, x, cache, block_tables, seq - q, jnp.full((b,), q, jnp.int32),
                           positions, kernels=kernels, decode=True)


# ---- checks -------------------------------------------------------------------------------------


def _check_call(fn, params, x, cache, block_tables, vec, vec_name) -> tuple[int, int]:
    """Trace-time checks shared by prefill and decode; returns (B, S)."""
    if not isinstance(params, AttentionParams):
        raise TypeError(f"{fn}: params must be AttentionParams, got {type(params).__name__}")
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"{fn}: cache must be a PagedKVCache, got {type(cache).__name__}")
    cfg = params.config
    if x.ndim != 3 or x.shape[-1] != cfg.hidden_size:
        raise ValueError(f"{fn}: x must be [B, S, H] with H=hidden_size={cfg.hidden_size}, "
                         f"got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{fn}: x must be floating point, got {x.dtype}")
    if (cache.num_kv_heads, cache.head_dim) != (cfg.num_kv_heads, cfg.head_dim):
        raise ValueError(f"{fn}: cache holds {cache.num_kv_heads} kv heads of dim "
                         f"{cache.head_dim}, the config {cfg.num_kv_heads} of dim {cfg.head_dim}")
    b, s, _ = x.shape
    bt = block_tables
    if not hasattr(bt, "ndim") or bt.ndim != 2 or bt.shape[0] != b:
        raise ValueError(f"{fn}: block_tables must be [B={b}, Pt], got shape "
                         f"{getattr(bt, 'shape', type(bt).__name__)}")
    if not jnp.issubdtype(bt.dtype, jnp.integer):
        raise TypeError(f"{fn}: block_tables must be integer page ids, got {bt.dtype}")
    _int_vector(fn, vec_name, vec, b)
    capacity = bt.shape[1] * cache.page_size
    if s > capacity:
        raise ValueError(f"{fn}: x has S={s} tokens a sequence, more than the block table "
                         f"holds ({bt.shape[1]} pages x {cache.page_size} = {capacity})")
    return b, s


def _int_vector(fn: str, name: str, v, b: int) -> jax.Array:
    v = jnp.asarray(v)
    if v.shape != (b,):
        raise ValueError(f"{fn}: {name} must be [B={b}], got shape {v.shape}")
    if not jnp.issubdtype(v.dtype, jnp.integer):
        raise TypeError(f"{fn}: {name} must be integer, got {v.dtype}")
    return v.astype(jnp.int32)


def _check_positions(fn: str, params: AttentionParams, positions, b: int, s: int) -> None:
    if positions is None:
        return
    mrope = params.config.rope.style is RopeStyle.MROPE
    allowed = [(b, s), (3, b, s)] if mrope else [(b, s)]
    if tuple(positions.shape) not in allowed:
        raise ValueError(f"{fn}: positions must be one of shapes {allowed}, got "
                         f"{tuple(positions.shape)}")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"{fn}: positions must be integer, got {positions.dtype}")


def _check_tables(cache: PagedKVCache, block_tables, start, end, what: str) -> None:
    check = functools.partial(check_tables, page_size=cache.page_size,
                              num_pages=cache.num_pages, what=what)
    host_check(check, block_tables, start, end)


def _check_lengths(lengths, *, s: int) -> None:
    bad = (lengths < 0) | (lengths > s)
    if bad.any():
        raise ValueError(f"lengths: expected values in [0, S={s}], got {lengths.tolist()}")


def _check_seq_lens(seq_lens, *, q: int) -> None:
    bad = seq_lens < q
    if bad.any():
        raise ValueError(f"seq_lens: must count the cache plus the Q={q} new tokens (>= {q}), "
                         f"got {seq_lens.tolist()}")
