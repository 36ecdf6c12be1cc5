"""Paged-attention decode: split-K (flash-decoding) Pallas kernel on the Triton lowering.

``q [B, Q, Hq, D]`` (Q = 1..4 new tokens per sequence, e.g. speculative verify) attends over
each sequence's pages of a paged KV cache (layout in ``reference.py`` / ``config.KVDtype``): the
token at position ``t`` of sequence ``b`` is row ``t % P`` of page ``block_tables[b, t // P]``.
Query ``i`` sits at position ``seq_lens[b] - Q + i`` and sees keys ``t <= `` its own (causal
among the Q new tokens), within the sliding window when one is set.

Grid ``(Hk, S, B)``, kv head fastest. One program takes ALL ``G = Hq / Hk`` query heads of one
kv head for all ``Q`` tokens (GQA packing): its query block is ``[R, D]`` with row
``r = i * G + g`` (query token i, head g of the group), ``R = Q * G`` padded to a power of two
>= 16 (tl.dot).
Each K/V byte is then read once per kv head, not once per query head. The program walks 1/S of
the sequence's pages -- the split is computed per sequence at run time, so ragged batches split
every sequence evenly -- ``pages_per_step`` pages per loop step: it reads their page ids from
the block table, gathers the ``[T, D]`` K and V rows of its kv head (``T = pages_per_step * P``
tokens, each row ``D`` contiguous elements: coalesced), dequantizes them in registers and runs
the online softmax in f32 (base 2) with the length / causal / window masks and the softcap.

Dequantization. FLOAT32 pages go to IEEE f32 dots and BF16 pages straight to bf16 dots (q is
cast to bf16). FP8 and NVFP4 pages become f16 dot operands: on sm_90 Triton converts e4m3 -> f16
with one ``cvt.rn.f16x2.e4m3x2`` per two values but e4m3 -> bf16 takes that plus two
``cvt.bf16.f16``, and conversions issue at a fraction of the FP32 rate, so the bf16 route would
make FP8 decode conversion-bound. e4m3 -> f16 is exact. Triton sinks that cast past the change
of V's layout to the MMA operand's (V ``[T, D]`` is the B operand with K = T but D contiguous:
no 8-bit ``ldmatrix.trans`` on sm_90), so V reaches the MMA layout as bytes read one at a time;
``DecodeConfig.v_convert="asm"`` (``k_convert`` for K) instead converts right after the load with
inline PTX (``_dequant.fp8_to_f16``, with a guard operand Triton does not hoist past) so the
layout change moves f16 (offline sm_90 build: no byte-wise shared-memory reads,
``ldmatrix.trans`` instead; 255 -> 168 registers, loop 1228 -> 986 instructions at B 32, 8
pages a step). On the H200 it measured slower all the same (24 of 34 FP8 grid cases; B 32 16k
356 vs 316 us), so "cast" stays the default. NVFP4 codes become f16 by bit
placement, ``((c & 7) << 9) | ((c & 8) << 12)`` = ``e2m1 * 2^-14`` (subnormal codes included;
``pallas_kernels._dequant.fp4_to_f16_scaled``: two values per 32-bit op in PTX on the GPU),
times the f16 block scale: exact (<= 5 significant bits) unless ``e2m1 * scale < 2^-6``, where
the f16 product is subnormal and may round (a block 2^15 times below its row's amax). f16 needs
a bounded q: each query row is scaled by a power of two to ``|q| < 2^11`` (exact) and the
logits by its inverse. The f32 per-token factors (FP8 scale, NVFP4 global, the 2^14) are not
applied to the tiles but to the logits' columns (K) and the probabilities' columns (V,
normalized by the step's largest factor so the f16 probabilities stay in range): ``T``
multiplies instead of ``T * D``. The NVFP4 low nibble is the even d, so instead of interleaving
the halves in registers the kernel splits q into its even and odd columns and keeps two
``[R, D/2]`` accumulators, written back to the even and odd output columns.

Splits and reduce. With ``num_splits == 1`` the program normalizes (sinks included) and writes
the final ``[B, Q, Hq, D]`` rows itself: one launch. With ``S > 1`` each program writes its
normalized partial ``o [B, Hk, S, Q*G, D]`` f32 and log-sum-exp ``[B, Hk, S, Q*G]`` f32 (-inf
for an empty split), and a second Pallas launch (``combine_kernel``) combines the splits with
the sinks by log-sum-exp and writes the ``[B, Q, Hq, D]`` rows in the output dtype: one program
per (partial row, block of columns), all S splits in one ``[next_pow2(S), columns]`` load.
``combine_splits`` is its plain-jnp statement. Measured on the H200 (benchmarks/RESULTS.md,
session 5), GPU time per step: B = 1 32k 27.8 -> 23.9 us, B = 1 16k 64/8 25.6 -> 23.1 us,
B >= 8 unchanged, against the jnp combine, which XLA compiled into 2-4 small launches (a first
Pallas combine, one program per row walking the splits 16 at a time, took 12 us alone).
The partials' traffic is ``2 * S * Q*G / L`` of the bf16 KV bytes of a sequence of length L
(3 % at B = 1, L = 32k, S = 66, Q*G = 8; far less at larger batch, where the heuristic picks
fewer splits, and none at S = 1).

The file reads top-down: helpers, the kernel body on refs, the ``pallas_call`` wrapper, the
split reduce (kernel, wrapper, jnp statement), the jitted public entry.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._dequant import (
    F16_FP4_FACTOR,
    e2m1_to_f16_scaled,
    fp4_to_f16_scaled,
    fp8_to_f16,
)
from pallas_kernels._device import device_sm_count
from pallas_kernels._offsets import bytes_of_pairs, check_offsets, pair_view_if_overflowing
from pallas_kernels.paged_attention.config import (
    HEAD_DIMS,
    MIN_DOT,
    NVFP4_GROUP,
    DecodeConfig,
    KVDtype,
    choose_decode_config,
)

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MAX_ROWS = 128  # Q * G rows of one program's query block

_Q_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_OUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_PAGE_DTYPES = {
    KVDtype.FLOAT32: jnp.float32,
    KVDtype.BF16: jnp.bfloat16,
    KVDtype.FP8: jnp.float8_e4m3fn,
    KVDtype.NVFP4: jnp.uint8,
}

# ---------------------------------------------------------------------------------------------
# In-kernel helpers (elementwise: no table lookups, which Triton has no cheap form of).
# ---------------------------------------------------------------------------------------------


def _pow2_row_scales(amax):
    """Row amax [R] f32 -> powers of two ``(up, down)`` [R] f32, ``amax * up in [2^10, 2^11)``.

    Built from the exponent bits of the amax (exact; clamped so both stay normal), so
    ``q * up`` fits f16 without overflow and ``logits * down`` undoes it.
    """
    e = (jax.lax.bitcast_convert_type(amax, jnp.int32) >> 23) & 0xFF  # biased exponent
    e = jnp.clip(e, 11, 254)
    up = jax.lax.bitcast_convert_type((264 - e) << 23, jnp.float32)  # 2^(10 - (e - 127))
    down = jax.lax.bitcast_convert_type((e - 10) << 23, jnp.float32)  # 2^((e - 127) - 10)
    return up, down


def _repeat_cols(s, times: int):
    """[r, c] -> [r, c * times], each column repeated ``times`` times."""
    r, c = s.shape
    return jnp.broadcast_to(s[:, :, None], (r, c, times)).reshape(r, c * times)


def _dot_nt(a, b, precision):
    """``a [m, k] @ b [n, k]^T`` -> [m, n] f32."""
    return jax.lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _dot_nn(a, b, precision):
    """``a [m, k] @ b [k, n]`` -> [m, n] f32."""
    return jax.lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _grid(rows, cols):
    """Indexer of the ``[len(rows), len(cols)]`` block ``ref[rows[i], cols[j]]``.

    Both as index arrays: the interpreter discharges loads and stores whose indices are all
    arrays (or all slices), not a mix, and no strided slices; Triton sees the same offsets.
    """
    return rows[:, None], cols[None, :]


def _zero_like(dtype):
    # A masked load's `other` is cast to the ref dtype in the lowering: Triton has int -> int
    # and float -> float8 casts, but no int -> float8 one.
    return 0 if jnp.issubdtype(dtype, jnp.integer) else 0.0


class _StaticKV:
    """What the decode and prefill kernels' ``_Static`` share: properties of ``kv_dtype``,
    ``pages_per_step`` and ``page_size`` (fields of the dataclasses deriving from this)."""

    @property
    def tokens_per_step(self) -> int:
        return self.pages_per_step * self.page_size

    @property
    def compute_dtype(self):
        """Dot operand dtype (see the module docstring for why f16 for FP8 and NVFP4)."""
        match self.kv_dtype:
            case KVDtype.FLOAT32:
                return jnp.float32
            case KVDtype.BF16:
                return jnp.bfloat16
            case KVDtype.FP8 | KVDtype.NVFP4:
                return jnp.float16

    @property
    def precision(self):
        return jax.lax.Precision.HIGHEST if self.kv_dtype is KVDtype.FLOAT32 else None


@dataclasses.dataclass(frozen=True)
class _Static(_StaticKV):
    """Everything the kernel body specializes on (hashable)."""

    kv_dtype: KVDtype
    q_len: int  # Q new tokens per sequence
    num_q_heads: int  # Hq
    num_kv_heads: int  # Hk
    group: int  # G = Hq // Hk
    head_dim: int  # D
    page_size: int  # P
    max_pages: int  # Pt, block-table width
    rows: int  # R: Q * G padded to a power of two >= 16
    pages_per_step: int
    num_splits: int  # S
    scale: float
    sliding_window: int | None
    logit_softcap: float | None
    inline_asm: bool  # GPU: NVFP4 unpack in PTX (interpret mode: the same bits in jnp)
    v_asm: bool = False  # FP8 V tile to f16 with inline PTX after the load (DecodeConfig)
    k_asm: bool = False  # the same for K

    @property
    def split_d(self) -> bool:
        """NVFP4 tiles are split into their even and odd d (module docstring)."""
        return self.kv_dtype is KVDtype.NVFP4


# ---------------------------------------------------------------------------------------------
# Pieces of the kernel body shared with prefill.py (each emits the same ops in the same order
# for both kernels).
# ---------------------------------------------------------------------------------------------


def load_q_block(q_ref, q_rows, col_sets, row_ok, compute_dtype, row_mask=None):
    """Gathers the ``[R, D]`` query block (NVFP4: its even and odd columns, ``[R, D/2]`` x 2) as
    dot operands: ``(q_halves, logit_rows)``.

    Rows ``q_rows`` of ``q_ref``, masked by ``row_ok`` [R] (``row_mask``: the ``[R, 1]`` mask
    when the caller already holds it). For f16 operands each row is scaled by a power of two to
    ``|q| < 2^11`` and ``logit_rows`` [R] is the inverse, to apply to the logits (else None).
    """
    q_halves = tuple(
        plgpu.load(
            q_ref.at[_grid(q_rows, cols)],
            mask=row_ok[:, None] if row_mask is None else row_mask,
            other=0.0,
        ).astype(jnp.float32)
        for cols in col_sets
    )  # [R, D] | NVFP4 [R, D/2] x 2
    logit_rows = None  # f16 operands: per-row power-of-two scaling of q, undone on the logits
    if compute_dtype == jnp.float16:
        amax_q = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(qh), axis=1) for qh in q_halves])
        up, logit_rows = _pow2_row_scales(amax_q)  # [R], [R]
        q_halves = tuple(qh * up[:, None] for qh in q_halves)
    return tuple(qh.astype(compute_dtype) for qh in q_halves), logit_rows


def load_kv_tile(
    kv_dtype: KVDtype,
    data_ref,
    scale_ref,
    global_ref,
    rows,
    tok_ok,
    inline_asm=None,
    fp8_asm: bool = False,
):
    """Gathers ``rows`` ([T] row ids) of one kv head: (tiles, f32 per-token factor [T] | None).

    Tiles are the dot operands: ``([T, D],)``, or NVFP4's ``(even d, odd d)`` [T, D/2] f16 (times
    2^-14, folded into the factor). ``tok_ok`` [T] masks the loads (None: no mask). NVFP4
    unpack: ``inline_asm`` None, the codes widened up front and placed in jnp (prefill); a
    bool, ``fp4_to_f16_scaled`` after the block scales (decode; True: PTX on the GPU). FP8:
    ``fp8_asm`` converts with ``fp8_to_f16`` (PTX when ``inline_asm``; ``DecodeConfig.v_convert``)
    instead of a cast Triton may move. A uint16 ``data_ref`` is the pair view of 1-byte pages
    (``_page_views``): each loaded pair is split back into its two bytes.
    """
    mask = None if tok_ok is None else tok_ok[:, None]
    cols = jnp.arange(data_ref.shape[1], dtype=jnp.int32)
    raw = plgpu.load(
        data_ref.at[_grid(rows, cols)],
        mask=mask,
        other=None if mask is None else _zero_like(data_ref.dtype),
    )
    if data_ref.dtype == jnp.uint16:  # byte pairs -> [T, 2 * cols] bytes
        raw = bytes_of_pairs(raw)
        if kv_dtype is KVDtype.FP8:
            raw = jax.lax.bitcast_convert_type(raw, jnp.float8_e4m3fn)
    other = None if tok_ok is None else 0.0
    match kv_dtype:
        case KVDtype.FLOAT32 | KVDtype.BF16:
            return (raw,), None
        case KVDtype.FP8:
            s = plgpu.load(scale_ref.at[rows], mask=tok_ok, other=other)  # [T] f32
            if fp8_asm:  # exact either way; cvt.rn.f16x2.e4m3x2
                return (fp8_to_f16(raw, bool(inline_asm)),), s
            return (raw.astype(jnp.float16),), s
        case KVDtype.NVFP4:
            codes = raw.astype(jnp.int32) if inline_asm is None else None  # [T, D/2]
            s_cols = jnp.arange(scale_ref.shape[1], dtype=jnp.int32)
            blk = plgpu.load(scale_ref.at[_grid(rows, s_cols)], mask=mask, other=other)
            blk = _repeat_cols(blk.astype(jnp.float16), NVFP4_GROUP // 2)  # [T, D/2]
            if inline_asm is None:
                lo_vals = e2m1_to_f16_scaled(codes) * blk  # even d, * 2^-14
                hi_vals = e2m1_to_f16_scaled(codes >> 4) * blk  # odd d, * 2^-14
                gs = plgpu.load(global_ref.at[rows], mask=tok_ok, other=other)  # [T] f32
                return (lo_vals, hi_vals), gs * F16_FP4_FACTOR
            lo, hi = fp4_to_f16_scaled(raw, inline_asm)  # even d, odd d; * 2^-14
            gs = plgpu.load(global_ref.at[rows], mask=tok_ok, other=other)  # [T] f32
            return (lo * blk, hi * blk), gs * F16_FP4_FACTOR


def step_logits(q_halves, k_tiles, k_tok, logit_rows, st):
    """The step's logits ``[R, T]`` f32 in base 2: q . K, the q row and K token factors, the
    scale and the softcap (``st``: ``scale``, ``logit_softcap``, ``precision``)."""
    s = _dot_nt(q_halves[0], k_tiles[0], st.precision)  # [R, T] f32
    for qh, kh in zip(q_halves[1:], k_tiles[1:], strict=True):
        s = s + _dot_nt(qh, kh, st.precision)
    if logit_rows is not None:
        s = s * logit_rows[:, None]
    if st.logit_softcap is None:
        logit_factor = st.scale * LOG2E  # logits in base 2 from here on
        s = s * (logit_factor if k_tok is None else (k_tok * logit_factor)[None, :])
    else:
        if k_tok is not None:
            s = s * k_tok[None, :]
        cap = st.logit_softcap
        s = jnp.tanh(s * (st.scale / cap)) * (cap * LOG2E)
    return s


def online_softmax(s, m_prev, l_prev):
    """One online-softmax step over the masked logits ``s`` [R, T] (base 2):
    ``(m_next, alpha, probs, l_next)``, alpha rescaling what was accumulated before."""
    m_next = jnp.maximum(m_prev, s.max(axis=1))  # [R]
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # a row that has seen nothing yet
    alpha = jnp.exp2(m_prev - m_safe)  # [R]
    probs = jnp.exp2(s - m_safe[:, None])  # [R, T]
    l_next = l_prev * alpha + probs.sum(axis=1)
    return m_next, alpha, probs, l_next


def probs_operand(probs, v_tok, compute_dtype):
    """The probabilities as the P . V dot operand: ``(probs, step_scale | None)``, the per-token
    V factor on their columns normalized by the step's largest (``step_scale``, applied to the
    dot's result) so that f16 probabilities keep their range."""
    step_scale = None
    if v_tok is not None:
        v_max = jnp.max(v_tok)
        v_max = jnp.where(v_max > 0, v_max, 1.0)
        probs = probs * (v_tok * (1.0 / v_max))[None, :]
        step_scale = v_max
    return probs.astype(compute_dtype), step_scale


def init_carry(rows, d_acc, num_accs):
    """The loop carry: ``num_accs`` f32 accumulators ``[R, d_acc]``, running max and sum [R]."""
    return (
        tuple(jnp.zeros((rows, d_acc), jnp.float32) for _ in range(num_accs)),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def fold_sinks(sinks_ref, heads, mask, m_i, l_i, accs):
    """One extra logit per head (``sinks_ref[heads]`` [R]), in the denominator only:
    ``(l_i, accs)`` rescaled to the new max."""
    sink = plgpu.load(sinks_ref.at[heads], mask=mask, other=0.0) * LOG2E  # [R]
    m_fin = jnp.maximum(m_i, sink)
    corr = jnp.exp2(m_i - m_fin)
    l_i = l_i * corr + jnp.exp2(sink - m_fin)
    return l_i, tuple(acc * corr[:, None] for acc in accs)


def kernel_operands(positions, block_tables, q, k_pages, k_scale, k_global, v_pages, v_scale,
                    v_global, sinks):
    """The ``pallas_call`` operands of either kernel: row-major (free) views, the per-token
    arrays ``[N, P, Hk, ...]`` as rows ``[N * P * Hk, ...]``."""
    flat_rows = lambda a: None if a is None else a.reshape(-1, *a.shape[3:])  # noqa: E731
    return (
        positions.reshape(-1),
        block_tables.reshape(-1),
        q.reshape(-1, q.shape[3]),
        flat_rows(k_pages),
        flat_rows(k_scale),
        flat_rows(k_global),
        flat_rows(v_pages),
        flat_rows(v_scale),
        flat_rows(v_global),
        sinks,
    )


# ---------------------------------------------------------------------------------------------
# Kernel body.
# ---------------------------------------------------------------------------------------------


def split_steps(seq_len, split, *, q_len: int, page_size: int, max_pages: int,
                pages_per_step: int, num_splits: int, sliding_window: int | None):
    """``(lo, hi, first_page, j0, j1)`` of split ``split`` of a sequence of ``seq_len`` tokens
    (traced int32): its keys ``[lo, hi)`` are read, from page ``first_page`` on, in page steps
    ``[j0, j1)`` (``pages_per_step`` pages a step; the sequence's steps cut into
    ``num_splits`` even, contiguous shares). Shared by the Triton and the Mosaic GPU kernels."""
    div, p, pps = jax.lax.div, page_size, pages_per_step
    hi = jnp.minimum(seq_len, max_pages * p)
    if sliding_window is None:
        lo = jnp.int32(0)
    else:
        lo = jnp.maximum(seq_len - q_len - sliding_window + 1, 0)
    first_page = div(lo, p)
    num_pages = jnp.maximum(div(hi + p - 1, p) - first_page, 0)
    num_steps = div(num_pages + pps - 1, pps)
    per_split = div(num_steps + num_splits - 1, num_splits)
    j0 = split * per_split
    j1 = jnp.minimum(j0 + per_split, num_steps)
    return lo, hi, first_page, j0, j1


def paged_decode_kernel(
    seq_lens_ref,  # [B] int32
    block_tables_ref,  # [B * Pt] int32 (flattened; page ids read per step)
    q_ref,  # [B * Q * Hq, D] bf16/f16/f32 (rows gathered per program)
    k_ref,  # [N * P * Hk, D] f32/bf16/e4m3 | [N * P * Hk, D // 2] u8 (NVFP4)
    k_scale_ref,  # FP8 [N * P * Hk] f32 | NVFP4 [N * P * Hk, D // 16] e4m3 | None
    k_global_ref,  # NVFP4 [N * P * Hk] f32 | None
    v_ref,  # as k_ref
    v_scale_ref,  # as k_scale_ref
    v_global_ref,  # as k_global_ref
    sinks_ref,  # [Hq] f32 | None (read here with one split; else in the reduce)
    o_ref,  # S == 1: [B * Q * Hq, D] out dtype | S > 1: [B * Hk * S * Q*G, D] f32
    *lse_refs,  # S > 1: [B * Hk * S * Q*G] f32 log-sum-exp of each partial row
    st: _Static,
):
    h, split, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    nq, g, d, p = st.q_len, st.group, st.head_dim, st.page_size
    r_pad, t_step, pps = st.rows, st.tokens_per_step, st.pages_per_step
    div, rem = jax.lax.div, jax.lax.rem  # non-negative operands: no floor fix-ups

    # ---- the query block: row r = i * G + g ----
    r = jnp.arange(r_pad, dtype=jnp.int32)
    qi, gi = div(r, g), rem(r, g)  # [R] query token, head within the group
    row_ok = r < nq * g  # [R]
    q_rows = (b * nq + qi) * st.num_q_heads + h * g + gi  # [R] rows of q_ref / final o_ref
    row_mask = row_ok[:, None]
    # Column sets: NVFP4 splits D into the even and odd columns (the low and high nibbles).
    col = jnp.arange(d // 2 if st.split_d else d, dtype=jnp.int32)
    col_sets = (2 * col, 2 * col + 1) if st.split_d else (col,)

    q_halves, logit_rows = load_q_block(
        q_ref, q_rows, col_sets, row_ok, st.compute_dtype, row_mask=row_mask
    )  # [R, D] | NVFP4 [R, D/2] x 2

    seq_len = seq_lens_ref[b]
    q_pos = seq_len - nq + qi  # [R] position of each row's query (padding rows: >= seq_len)
    lo, hi, first_page, j0, j1 = split_steps(
        seq_len, split, q_len=nq, page_size=p, max_pages=st.max_pages, pages_per_step=pps,
        num_splits=st.num_splits, sliding_window=st.sliding_window)

    tt = jnp.arange(t_step, dtype=jnp.int32)  # token within the step
    kv_row_in_page = rem(tt, p) * st.num_kv_heads + h  # [T]


    def body(j, carry):
        accs, m_prev, l_prev = carry
        page0 = first_page + j * pps
        pos = page0 * p + tt  # [T] key positions
        tok_ok = (pos >= lo) & (pos < hi)  # [T]
        page_ids = plgpu.load(
            block_tables_ref.at[b * st.max_pages + page0 + div(tt, p)], mask=tok_ok, other=0
        )  # [T] page id of each token (one id per page, broadcast by the cache)
        rows = page_ids * (p * st.num_kv_heads) + kv_row_in_page  # [T] rows of k_ref / v_ref

        load = functools.partial(load_kv_tile, st.kv_dtype, inline_asm=st.inline_asm)
        k_tiles, k_tok = load(k_ref, k_scale_ref, k_global_ref, rows, tok_ok, fp8_asm=st.k_asm)
        v_tiles, v_tok = load(v_ref, v_scale_ref, v_global_ref, rows, tok_ok, fp8_asm=st.v_asm)

        s = step_logits(q_halves, k_tiles, k_tok, logit_rows, st)  # [R, T] f32

        visible = tok_ok[None, :] & (pos[None, :] <= q_pos[:, None])  # [R, T]
        if st.sliding_window is not None:
            visible &= pos[None, :] > (q_pos - st.sliding_window)[:, None]
        s = jnp.where(visible, s, -jnp.inf)

        m_next, alpha, probs, l_next = online_softmax(s, m_prev, l_prev)
        out_scale = alpha[:, None]  # [R, 1] rescales the accumulator before this step's sum
        probs, step_scale = probs_operand(probs, v_tok, st.compute_dtype)
        new_accs = []
        for acc, vt in zip(accs, v_tiles, strict=True):
            pv = _dot_nn(probs, vt, st.precision)  # [R, D(/2)]
            new_accs.append(acc * out_scale + (pv if step_scale is None else pv * step_scale))
        return tuple(new_accs), m_next, l_next

    d_acc = d // 2 if st.split_d else d
    accs, m_i, l_i = jax.lax.fori_loop(j0, j1, body, init_carry(r_pad, d_acc, len(q_halves)))

    if st.num_splits == 1:
        if sinks_ref is not None:  # one extra logit per head, in the denominator only
            l_i, accs = fold_sinks(sinks_ref, h * g + gi, row_ok, m_i, l_i, accs)
        out_rows = q_rows
    else:
        out_rows = ((b * st.num_kv_heads + h) * st.num_splits + split) * (nq * g) + r
    # Masked rows point past the end: the GPU skips them, the interpreter's scatter drops them.
    out_rows = jnp.where(row_ok, out_rows, o_ref.shape[0])
    if st.num_splits > 1:
        lse = jnp.where(l_i > 0, (m_i + jnp.log2(jnp.where(l_i > 0, l_i, 1.0))) * LN2, -jnp.inf)
        plgpu.store(lse_refs[0].at[out_rows], lse, mask=row_ok)

    inv_l = jnp.where(l_i > 0, 1.0 / jnp.where(l_i > 0, l_i, 1.0), 0.0)[:, None]  # no key: 0
    for acc, cols in zip(accs, col_sets, strict=True):
        out = (acc * inv_l).astype(o_ref.dtype)
        plgpu.store(o_ref.at[_grid(out_rows, cols)], out, mask=row_mask)


# ---------------------------------------------------------------------------------------------
# pallas_call wrapper.
# ---------------------------------------------------------------------------------------------


def _paged_decode_pallas(
    seq_lens,  # [B] int32
    block_tables,  # [B, Pt] int32
    q,  # [B, Q, Hq, D]
    k_pages,  # [N, P, Hk, D] | [N, P, Hk, D // 2] u8
    k_scale,  # FP8 [N, P, Hk] | NVFP4 [N, P, Hk, D // 16] | None
    k_global,  # NVFP4 [N, P, Hk] | None
    v_pages,
    v_scale,
    v_global,
    sinks,  # [Hq] f32 | None
    *,
    st: _Static,
    config: DecodeConfig,
    out_dtype,
    interpret: bool,
):
    b = q.shape[0]
    rows = q.shape[0] * q.shape[1] * q.shape[2]
    qg = st.q_len * st.group
    if st.num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((rows, st.head_dim), out_dtype)  # final rows
    else:
        parts = b * st.num_kv_heads * st.num_splits * qg
        out_shape = (
            jax.ShapeDtypeStruct((parts, st.head_dim), jnp.float32),  # partial o
            jax.ShapeDtypeStruct((parts,), jnp.float32),  # partial lse
        )
    # No BlockSpecs: every operand is passed whole (a pointer in Triton). The pages a program
    # reads are data-dependent (block_tables), its q and output rows are strided gathers of
    # the GQA group, and row counts like Q * G = 12 are not powers of two, so the kernel
    # computes its own row indices and masks. All reshapes below are free (row-major views).
    out = pl.pallas_call(
        functools.partial(paged_decode_kernel, st=st),
        # kv head fastest: the Hk programs of one (split, sequence) run side by side and read
        # the same pages (rows interleaved by head; shared lines for NVFP4 bytes and scales).
        grid=(st.num_kv_heads, st.num_splits, b),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name=(
            f"paged_decode_{st.kv_dtype.value}_d{st.head_dim}_r{st.rows}"
            f"_t{st.tokens_per_step}_s{st.num_splits}"
            + ("_kasm" if st.k_asm else "")
            + ("_vasm" if st.v_asm else "")
        ),
    )(
        *kernel_operands(
            seq_lens,
            block_tables,
            q,
            k_pages,
            k_scale,
            k_global,
            v_pages,
            v_scale,
            v_global,
            sinks if st.num_splits == 1 else None,
        )
    )
    if st.num_splits == 1:
        return out.reshape(q.shape[:3] + (st.head_dim,))
    o, lse = out
    return combine_pallas(o, lse, sinks, st=st, batch=b, out_dtype=out_dtype,
                          interpret=interpret).reshape(q.shape[:3] + (st.head_dim,))


# ---------------------------------------------------------------------------------------------
# Split reduce: a second, wide Pallas launch (``combine_splits`` is its jnp statement).
# ---------------------------------------------------------------------------------------------

COMBINE_TILE = 4096  # f32 elements of one combine program's [span, columns] tile of partials


@dataclasses.dataclass(frozen=True)
class SplitShape:
    """What the split combine specializes on (``_Static`` has the same fields; the Mosaic GPU
    FP8 kernel, ``mosaic.py``, passes this)."""

    q_len: int
    num_q_heads: int
    num_kv_heads: int
    num_splits: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def combine_columns(num_splits: int, head_dim: int) -> tuple[int, int]:
    """``(span, columns)`` of a combine program: all ``num_splits`` partials at once (``span``
    = next power of two >= S, >= 2), over as many output columns as keep the tile within
    ``COMBINE_TILE`` (>= 16; a power of two dividing ``head_dim``)."""
    span = max(2, pl.next_power_of_2(num_splits))
    return span, max(16, min(head_dim, COMBINE_TILE // span))


def combine_kernel(o_ref, lse_ref, sinks_ref, out_ref, *, st: _Static | SplitShape, span: int,
                   cols: int):
    """Columns ``[c * cols, (c + 1) * cols)`` of one output row ``(b, q, h)`` of a split decode:
    the log-sum-exp combination of its ``num_splits`` partial rows and the sink, read in one
    ``[span, cols]`` load (no loop: one round trip to L2). Partial rows are ordered ``(b, kv
    head, split, q * G + g)``; output rows ``(b, q, kv head * G + g)``."""
    qg = st.q_len * st.group
    row, c = pl.program_id(0), pl.program_id(1)  # row: (b, kv head, q * G + g)
    div, rem = jax.lax.div, jax.lax.rem
    r, bh = rem(row, qg), div(row, qg)  # bh = b * Hk + kv head
    head = rem(bh, st.num_kv_heads) * st.group + rem(r, st.group)
    out_row = (div(bh, st.num_kv_heads) * st.q_len + div(r, st.group)) * st.num_q_heads + head
    s_idx = jnp.arange(span, dtype=jnp.int32)
    ok = s_idx < st.num_splits
    parts = bh * st.num_splits * qg + r + s_idx * qg  # [span] partial rows of this output row
    cc = c * cols + jnp.arange(cols, dtype=jnp.int32)
    lse = plgpu.load(lse_ref.at[parts], mask=ok, other=-jnp.inf)  # [span]
    part = plgpu.load(o_ref.at[_grid(parts, cc)], mask=ok[:, None], other=0.0)  # [span, cols]
    mx = jnp.max(lse)
    if sinks_ref is not None:
        sink = jnp.max(plgpu.load(sinks_ref.at[jnp.full((1,), head, jnp.int32)]))  # scalar
        mx = jnp.maximum(mx, sink)
    mx = jnp.where(mx > -jnp.inf, mx, 0.0)  # no split saw a key (and no sink)
    w = jnp.exp(lse - mx)  # [span]; 0 past S and for empty splits
    den = jnp.sum(w)
    if sinks_ref is not None:
        den = den + jnp.exp(sink - mx)
    num = jnp.sum(w[:, None] * part, axis=0)  # [cols]
    out = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
    plgpu.store(out_ref.at[jnp.full((1,), out_row, jnp.int32)[:, None], cc[None, :]],
                out[None, :].astype(out_ref.dtype))


def combine_pallas(o, lse, sinks, *, st: _Static | SplitShape, batch: int, out_dtype,
                   interpret: bool) -> jax.Array:
    """``combine_splits`` as one launch: ``[B * Q * Hq, D]`` rows from the partial ``o``
    ``[B * Hk * S * Q * G, D]`` and ``lse`` ``[B * Hk * S * Q * G]``; grid (partial rows of
    one split, column blocks)."""
    span, cols = combine_columns(st.num_splits, st.head_dim)
    rows = batch * st.num_kv_heads * st.q_len * st.group
    return pl.pallas_call(
        functools.partial(combine_kernel, st=st, span=span, cols=cols),
        grid=(rows, st.head_dim // cols),
        out_shape=jax.ShapeDtypeStruct((batch * st.q_len * st.num_q_heads, st.head_dim),
                                       out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=f"paged_decode_combine_d{st.head_dim}_s{st.num_splits}_c{cols}",
    )(o, lse, None if sinks is None else sinks.astype(jnp.float32))


def combine_splits(
    o: jax.Array,  # [B, Hk, S, Q*G, D] f32, each split's normalized output
    lse: jax.Array,  # [B, Hk, S, Q*G] f32, each split's log-sum-exp (-inf: saw no key)
    sinks: jax.Array | None,  # [Hq] sink logits
    *,
    q_len: int,
) -> jax.Array:  # [B, Q, Hq, D] f32
    """Log-sum-exp combination of the splits (and the sinks, denominator only): the plain-jnp
    statement of ``combine_kernel`` (the tests' reference)."""
    b, hk, _, qg, d = o.shape
    g = qg // q_len
    mx = lse.max(axis=2)  # [B, Hk, Q*G]
    if sinks is not None:
        sink = jnp.tile(sinks.astype(jnp.float32).reshape(hk, g), (1, q_len))[None]  # [1,Hk,QG]
        mx = jnp.maximum(mx, sink)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w = jnp.exp(lse - mx[:, :, None])  # [B, Hk, S, Q*G]
    den = w.sum(axis=2)  # [B, Hk, Q*G]
    if sinks is not None:
        den = den + jnp.exp(sink - mx)
    num = (w[..., None] * o).sum(axis=2)  # [B, Hk, Q*G, D]: one fused loop, no matmul
    out = jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
    out = out.reshape(b, hk, q_len, g, d).transpose(0, 2, 1, 3, 4)  # [B, Q, Hk, G, D]
    return out.reshape(b, q_len, hk * g, d)


# ---------------------------------------------------------------------------------------------
# Public entry.
# ---------------------------------------------------------------------------------------------


def _expect_shape(name, arr, shape):
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(arr.shape)}")


def _expect_dtype(name, arr, dtypes):
    if arr.dtype not in [jnp.dtype(dt) for dt in dtypes]:
        allowed = ", ".join(str(jnp.dtype(dt)) for dt in dtypes)
        raise TypeError(f"{name}: expected dtype in ({allowed}), got {arr.dtype}")


def _expect_none(name, arr, why):
    if arr is not None:
        raise ValueError(f"{name}: must be None ({why})")


def _check_scales(kv_dtype, n, p, hk, d, scales):
    """Validates the per-dtype scale arrays of K and V; returns them as the kernel takes them."""
    out = {}
    for which in ("k", "v"):
        s_name, g_name = f"{which}_scale", f"{which}_global_scale"
        s, gs = scales[s_name], scales[g_name]
        match kv_dtype:
            case KVDtype.FLOAT32 | KVDtype.BF16:
                _expect_none(s_name, s, f"{kv_dtype.value} pages have no scales")
                _expect_none(g_name, gs, f"{kv_dtype.value} pages have no scales")
            case KVDtype.FP8:
                if s is None:
                    raise ValueError(f"{s_name}: FP8 pages need a [N, P, Hk] f32 scale")
                _expect_shape(s_name, s, (n, p, hk))
                _expect_dtype(s_name, s, (jnp.float32, jnp.bfloat16, jnp.float16))
                _expect_none(g_name, gs, "only NVFP4 pages have a global scale")
                s = s.astype(jnp.float32)
            case KVDtype.NVFP4:
                if s is None or gs is None:
                    raise ValueError(
                        f"{s_name}, {g_name}: NVFP4 pages need a [N, P, Hk, D//16] e4m3 scale "
                        "and a [N, P, Hk] f32 global scale"
                    )
                _expect_shape(s_name, s, (n, p, hk, d // NVFP4_GROUP))
                _expect_dtype(s_name, s, (jnp.float8_e4m3fn,))
                _expect_shape(g_name, gs, (n, p, hk))
                _expect_dtype(g_name, gs, (jnp.float32, jnp.bfloat16, jnp.float16))
                gs = gs.astype(jnp.float32)
        out[s_name], out[g_name] = s, gs
    return out


def _check_pages(q, k_pages, v_pages, block_tables, kv_dtype):
    """Checks the pages and the block table against ``q [B, S, Hq, D]``; returns N, P, Hk."""
    b, _, hq, d = q.shape
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages: expected rank 4 [N, P, Hk, D], got shape {k_pages.shape}")
    n, p, hk, d_store = k_pages.shape
    _expect_shape("v_pages", v_pages, k_pages.shape)
    _expect_dtype("k_pages", k_pages, (_PAGE_DTYPES[kv_dtype],))
    _expect_dtype("v_pages", v_pages, (_PAGE_DTYPES[kv_dtype],))
    d_kv = 2 * d_store if kv_dtype is KVDtype.NVFP4 else d_store
    if d_kv != d:
        raise ValueError(
            f"k_pages: head_dim {d_kv} (last dim {d_store}, kv_dtype {kv_dtype.value}) does not "
            f"match q's head_dim {d}"
        )
    if hq % hk:
        raise ValueError(f"q: {hq} query heads are not a multiple of the {hk} kv heads of k_pages")
    if block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables: expected shape ({b}, Pt), got {block_tables.shape}")
    if not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise TypeError(f"block_tables: expected an integer dtype, got {block_tables.dtype}")
    return n, p, hk


def _out_dtype(q, out_dtype):
    """The output dtype (default: q's), checked."""
    out_dtype = jnp.dtype(q.dtype if out_dtype is None else out_dtype)
    if out_dtype not in [jnp.dtype(t) for t in _OUT_DTYPES]:
        raise NotImplementedError(f"out_dtype: {out_dtype} not supported (bf16, f16, f32)")
    return out_dtype


def _check_options(scale, sliding_window, logit_softcap) -> None:
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"scale: expected a positive float, got {scale!r}")
    w = sliding_window
    if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w <= 0):
        raise ValueError(f"sliding_window: expected a positive int or None, got {w!r}")
    c = logit_softcap
    if c is not None and (not isinstance(c, (int, float)) or not c > 0):
        raise ValueError(f"logit_softcap: expected a positive float or None, got {c!r}")


def check_decode_inputs(q, k_pages, v_pages, block_tables, seq_lens, sinks, *,
                        kv_dtype: KVDtype, scales: dict, scale, sliding_window, logit_softcap,
                        out_dtype):
    """The argument checks of the decode entries (``paged_decode``, ``mosaic.
    paged_decode_mosaic``): ValueError / TypeError naming the argument. Returns ``(N, P, Hk,
    scales as the kernels take them, the output dtype)``."""
    if q.ndim != 4:
        raise ValueError(f"q: expected rank 4 [B, Q, Hq, D], got shape {q.shape}")
    b, _, hq, d = q.shape
    if q.dtype not in [jnp.dtype(t) for t in _Q_DTYPES]:
        raise TypeError(f"q: expected dtype bf16, f16 or f32, got {q.dtype}")
    n, p, hk = _check_pages(q, k_pages, v_pages, block_tables, kv_dtype)
    _expect_shape("seq_lens", seq_lens, (b,))
    if not jnp.issubdtype(seq_lens.dtype, jnp.integer):
        raise TypeError(f"seq_lens: expected an integer dtype, got {seq_lens.dtype}")
    if sinks is not None:
        _expect_shape("sinks", sinks, (hq,))
    scales = _check_scales(kv_dtype, n, p, hk, d, scales)
    _check_options(scale, sliding_window, logit_softcap)
    return n, p, hk, scales, _out_dtype(q, out_dtype)


def _page_views(k_pages, v_pages, k_scale, v_scale) -> tuple[jax.Array, jax.Array]:
    """The K / V pages as the kernels read them: 1-byte pages (FP8, NVFP4) whose int32 offsets
    would overflow in Pallas' Triton lowering (2^31..2^32 elements) through their uint16 pair
    view (``load_kv_tile`` splits the pairs); NotImplementedError for such an NVFP4 block-scale
    array (read element-wise, no view)."""
    check_offsets(dict(k_scale=k_scale, v_scale=v_scale))
    return (pair_view_if_overflowing("k_pages", k_pages)[0],
            pair_view_if_overflowing("v_pages", v_pages)[0])


@functools.partial(
    jax.jit,
    static_argnames=(
        "kv_dtype",
        "scale",
        "sliding_window",
        "logit_softcap",
        "config",
        "out_dtype",
        "interpret",
    ),
)
def paged_decode(
    q: jax.Array,  # [B, Q, Hq, D] bf16/f16/f32
    k_pages: jax.Array,  # [N, P, Hk, D] f32/bf16/e4m3 | NVFP4 [N, P, Hk, D//2] u8
    v_pages: jax.Array,  # as k_pages
    block_tables: jax.Array,  # [B, Pt] int32 page ids
    seq_lens: jax.Array,  # [B] int32: cached tokens + the Q new ones
    *,
    kv_dtype: KVDtype | str,
    k_scale: jax.Array | None = None,  # FP8 [N, P, Hk] f32 | NVFP4 [N, P, Hk, D//16] e4m3
    v_scale: jax.Array | None = None,
    k_global_scale: jax.Array | None = None,  # NVFP4 [N, P, Hk] f32
    v_global_scale: jax.Array | None = None,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,  # [Hq] sink logits (gpt-oss)
    config: DecodeConfig | None = None,
    out_dtype=None,  # default: q.dtype
    interpret: bool = False,
) -> jax.Array:  # [B, Q, Hq, D]
    """Paged-attention decode of ``Q`` new tokens per sequence (semantics: module docstring
    and ``reference.paged_decode_reference``, which this matches).

    ``config=None`` picks one with ``choose_decode_config`` from the shapes and the device's SM
    count. ``interpret=True`` runs the Pallas interpreter (CPU tests).

    Contract (not checked: the values are traced): ``seq_lens[b] <= Pt * P`` (longer sequences
    are cut at the table's capacity) and the table entries of pages a sequence uses (positions
    ``[window start, seq_len)``) are valid page ids; other entries and page rows are never
    read. A query that sees no key (``seq_lens[b] < Q``) and has no sink outputs 0.

    Raises ValueError/TypeError naming the argument for malformed inputs and
    NotImplementedError for unsupported combinations (head_dim not in 64/128/256/512, a page
    size that is not a power of two, more than 128 query rows per kv head).
    """
    kv_dtype = KVDtype.coerce(kv_dtype)
    n, p, hk, scales, out_dtype = check_decode_inputs(
        q, k_pages, v_pages, block_tables, seq_lens, sinks, kv_dtype=kv_dtype,
        scales=dict(k_scale=k_scale, v_scale=v_scale, k_global_scale=k_global_scale,
                    v_global_scale=v_global_scale),
        scale=scale, sliding_window=sliding_window, logit_softcap=logit_softcap,
        out_dtype=out_dtype)
    b, nq, hq, d = q.shape
    if config is not None and not isinstance(config, DecodeConfig):
        raise TypeError(f"config: expected a DecodeConfig or None, got {type(config).__name__}")

    # ---- unsupported combinations ----
    if d not in HEAD_DIMS:
        raise NotImplementedError(f"head_dim {d}: the decode kernel tiles D in {HEAD_DIMS}")
    if p & (p - 1):
        raise NotImplementedError(
            f"page_size {p}: the decode kernel needs a power of two (Triton block shapes)"
        )
    rows = max(MIN_DOT, 1 << max(0, math.ceil(math.log2(nq * (hq // hk)))))
    if rows > MAX_ROWS:
        raise NotImplementedError(
            f"q: Q * Hq / Hk = {nq} * {hq // hk} query rows per kv head exceed {MAX_ROWS}"
        )
    if n * p * hk >= 2**31:
        raise NotImplementedError(f"k_pages: {n * p * hk} rows exceed the kernel's int32 row ids")
    k_pages, v_pages = _page_views(k_pages, v_pages, k_scale, v_scale)

    if b == 0 or nq == 0 or block_tables.shape[1] == 0:  # nothing to read: every row is 0
        return jnp.zeros(q.shape, out_dtype)
    if config is None:
        config = choose_decode_config(
            b, hk, hq // hk, nq, block_tables.shape[1], p, d, kv_dtype, device_sm_count()
        )
    config.check(p, kv_dtype)

    st = _Static(
        kv_dtype=kv_dtype,
        q_len=nq,
        num_q_heads=hq,
        num_kv_heads=hk,
        group=hq // hk,
        head_dim=d,
        page_size=p,
        max_pages=block_tables.shape[1],
        rows=rows,
        pages_per_step=config.pages_per_step,
        num_splits=config.num_splits,
        scale=float(scale),
        sliding_window=sliding_window,
        logit_softcap=None if logit_softcap is None else float(logit_softcap),
        inline_asm=not interpret,
        v_asm=config.v_convert == "asm",
        k_asm=config.k_convert == "asm",
    )
    return _paged_decode_pallas(
        seq_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        q,
        k_pages,
        scales["k_scale"],
        scales["k_global_scale"],
        v_pages,
        scales["v_scale"],
        scales["v_global_scale"],
        None if sinks is None else sinks.astype(jnp.float32),
        st=st,
        config=config,
        out_dtype=out_dtype,
        interpret=interpret,
    )
