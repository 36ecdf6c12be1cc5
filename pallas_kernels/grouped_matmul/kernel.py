"""Grouped (ragged) matmul of MoE experts: Pallas kernel on the Triton lowering.

``out[M, N] = x[M, K] @ W[g]^T`` for the rows of each group ``g``: the rows of ``x`` are sorted by
group and ``group_sizes [G]`` counts them. Rows past ``sum(group_sizes)`` are padding and are
written as 0 (every output element is written exactly once). Group boundaries are clamped to
``[0, M]``: a negative size counts as 0 and rows past ``M`` do not exist.

Work list. The groups plus one padding segment ``[sum, M)`` cut the rows into ``G + 1``
segments; each is split into ``cdiv(rows, block_m)`` row tiles. Their number is at most
``min(M, cdiv(M, block_m) + G)`` (each tile holds >= 1 row, and all but one partial tile per
segment are full), so the grid is ``(that bound, cdiv(N, block_n))`` and a small on-device table
``tiles [3, T]`` (segment id, first row, end row) maps program 0-axis ids to tiles. It is computed
from ``group_sizes`` with a cumsum and a compare-and-count (no host sync). Programs past the real
tile count find segment ``G + 1`` and exit; tiles of segment ``G`` store zeros.

Weights are dequantized per K step in registers: FP8 block scales are applied to the f32 dot
result per K step (``block_k`` divides the scale block); NVFP4 (E4M3 per 16 of K) and MXFP4
(E8M0 per 32 of K) scales multiply the unpacked E2M1 values before the bf16 dot; the NVFP4
global scale (per row segment) multiplies the accumulator once. W8A8 takes activations
quantized per token per 128 of K (outside the kernel, one pass over x) and applies both scales
to each step's f32 dot; the operands go to the dot as exact bf16 upcasts by default, or as e4m3
with ``fp8_dot=True`` (see ``grouped_matmul`` for why). ``TileConfig.swap_ab`` computes the
transposed tile so that decode-sized row tiles still map onto Hopper's wgmma (M >= 64).

The fused gate_up variant reads ``W [G, 2I, K]`` through a free reshape, to ``[G, 2, I, K]``
(concatenated) or ``[G, I, 2, K]`` (interleaved), computes the gate and up accumulators of one
``[block_m, block_n]`` tile of ``I`` from one x tile, adds the per-group bias and writes only
``act(gate) * up``.

The file reads top-down: dequantization helpers, the kernel body on refs, the ``pallas_call``
wrapper, the jitted public entry.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._dequant import F16_FP4_FACTOR, e2m1_to_f32, e8m0_to_f32, fp4_to_f16_scaled
from pallas_kernels._device import device_kind, device_sm_count
from pallas_kernels._offsets import bytes_of_pairs, check_offsets, pair_view_if_overflowing
from pallas_kernels.grouped_matmul.config import (
    FP8_ACT_GROUP,
    MXFP4_GROUP,
    NVFP4_GROUP,
    Activation,
    ActivationQuant,
    GateUpLayout,
    TileConfig,
    WeightFormat,
    choose_tile_config,
)
from pallas_kernels.grouped_matmul.reference import (
    GPT_OSS_ALPHA,
    GPT_OSS_LIMIT,
    quantize_activations_fp8,
)
from pallas_kernels.grouped_matmul.tuned import tuned_key, tuned_tile_config

_SQRT_2_OVER_PI = 0.7978845608028654
_OUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_X_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)

# ---------------------------------------------------------------------------------------------
# In-kernel dequantization helpers (the conversions themselves: pallas_kernels._dequant).
# ---------------------------------------------------------------------------------------------


_e2m1_to_f32, _e8m0_to_f32 = e2m1_to_f32, e8m0_to_f32  # old names (moe_decode, tests)


def _repeat_cols(s, times: int):
    """[r, c] -> [r, c * times], each column repeated ``times`` times."""
    r, c = s.shape
    return jnp.broadcast_to(s[:, :, None], (r, c, times)).reshape(r, c * times)


def _interleave_cols(even, odd):
    """[r, c] x 2 -> [r, 2c] with ``out[:, 2j] = even[:, j]`` (tt.join + reshape)."""
    r, c = even.shape
    return jnp.stack([even, odd], axis=-1).reshape(r, 2 * c)


def _gated(gate, up, activation: Activation, alpha: float, limit: float):
    match activation:
        case Activation.SILU:
            return gate * jax.nn.sigmoid(gate) * up
        case Activation.GELU_TANH:
            inner = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
            return 0.5 * gate * (1.0 + jnp.tanh(inner)) * up
        case Activation.GPT_OSS:
            g = jnp.minimum(gate, limit)
            u = jnp.clip(up, -limit, limit)
            return (u + 1.0) * g * jax.nn.sigmoid(alpha * g)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernel body specializes on (hashable)."""

    fmt: WeightFormat
    halves: int  # 1 plain, 2 fused gate_up
    layout: GateUpLayout  # how halves sit in w (INTERLEAVED: [G, I, 2, Kw], else [G, H, I, Kw])
    activation: Activation | None
    w8a8: bool
    num_groups: int
    m: int
    n: int  # output columns per half (I when fused)
    k: int
    block_m: int
    block_n: int
    block_k: int
    swap_ab: bool
    fp8_block: tuple[int, int]
    global_rows: int  # NVFP4: rows of W (over all halves) sharing one global scale
    compute_dtype: jnp.dtype  # dot operand dtype
    inline_asm: bool  # GPU: FP4 unpack in PTX (interpret mode: the same bits in jnp)
    w_pairs: bool  # w_ref is the uint16 view of 1-byte weights (pallas_kernels._offsets)
    alpha: float
    limit: float


# ---------------------------------------------------------------------------------------------
# Kernel body.
# ---------------------------------------------------------------------------------------------


def grouped_matmul_kernel(
    tiles_ref,  # [3, T] int32: segment (G = padding rows, G+1 = idle), row start, row end
    x_ref,  # [M, K] bf16/f16/f32, or e4m3 for W8A8
    x_scale_ref,  # [M, cdiv(K, 128)] f32 (W8A8) | None
    w_ref,  # [G, H, N, Kw] (plain H=1, concatenated H=2) | [G, N, 2, Kw] (interleaved)
    scale_ref,  # FP8: [G, cdiv(H*N, b0), cdiv(K, b1)] f32 | NVFP4/MXFP4: as w_ref, K/16 or K/32
    global_ref,  # [G, R] f32 (NVFP4) | None
    bias_ref,  # as w_ref without the K axis | None
    o_ref,  # [M, N] out dtype
    *,
    st: _Static,
):
    bm, bn, bk = st.block_m, st.block_n, st.block_k
    t = pl.program_id(0)
    n0 = pl.multiple_of(pl.program_id(1) * bn, bn)
    seg = tiles_ref[0, t]
    row0 = tiles_ref[1, t]
    row1 = tiles_ref[2, t]

    rows = row0 + jnp.arange(bm, dtype=jnp.int32)
    row_mask = rows < row1  # [bm]
    cols = n0 + jnp.arange(bn, dtype=jnp.int32)
    n_ragged = st.n % bn != 0
    col_mask = cols < st.n  # [bn]
    out_mask = row_mask[:, None] & col_mask[None, :] if n_ragged else row_mask[:, None]
    out_slice = o_ref.at[pl.ds(row0, bm), pl.ds(n0, bn)]

    interleaved = st.layout is GateUpLayout.INTERLEAVED

    def w_index(g, h, col_slice, k_slice=None):
        """Indexer into w_ref / scale_ref / bias_ref (k_slice None: bias, no K axis)."""
        h = jnp.int32(h)  # a Python int index trips the interpret-mode load discharge
        head = (g, col_slice, h) if interleaved else (g, h, col_slice)
        return head if k_slice is None else (*head, k_slice)

    def orig_rows(h):
        """Row of the unreshaped ``w [G, H*N, K]`` behind each output column of half h."""
        return 2 * cols + h if interleaved else h * st.n + cols

    # Non-negative integer divisions as lax.div (jnp's floor_divide adds sign fix-ups).
    div = jax.lax.div

    def masked_load(ref_at, mask):
        if mask is None:
            return plgpu.load(ref_at)
        # `other` is cast to the ref dtype: Triton has int->float8 casts, but no float8 ones.
        other = 0 if jnp.issubdtype(ref_at.dtype, jnp.integer) else 0.0
        return plgpu.load(ref_at, mask=mask, other=other)

    def load_w_cols(g, h, kb, step, row_len):
        """``[bn, step]`` of ``w_ref[g, h]``'s columns ``[kb*step, (kb+1)*step)`` (masked past
        N and ``row_len``). With ``st.w_pairs`` w_ref holds byte pairs as uint16 (low byte
        first): read ``step/2`` pairs and split them into their uint8 bytes."""
        if st.w_pairs:
            step, row_len = step // 2, row_len // 2
        mask_parts = [col_mask[:, None]] if n_ragged else []
        if st.k % bk:
            mask_parts.append((kb * step + jnp.arange(step) < row_len)[None, :])
        mask = functools.reduce(jnp.logical_and, mask_parts) if mask_parts else None
        w = masked_load(w_ref.at[w_index(g, h, pl.ds(n0, bn), pl.ds(kb * step, step))], mask)
        return bytes_of_pairs(w) if st.w_pairs else w

    def load_w(g, h, kb):
        """Returns ([bn, bk] dot operand, [bn] f32 per-column scale of this K step or None)."""
        k_ragged = st.k % bk != 0
        mask_parts = []
        if n_ragged:
            mask_parts.append(col_mask[:, None])
        match st.fmt:
            case WeightFormat.BF16 | WeightFormat.FP8_BLOCK:
                w = load_w_cols(g, h, kb, bk, st.k)
                if st.fmt is WeightFormat.BF16:
                    return w.astype(st.compute_dtype), None
                if st.w_pairs:  # bytes -> e4m3
                    w = jax.lax.bitcast_convert_type(w, jnp.float8_e4m3fn)
                b0, b1 = st.fp8_block
                s_idx = (g, div(orig_rows(h), b0), div(kb, b1 // bk))
                s = (
                    plgpu.load(scale_ref.at[s_idx], mask=col_mask, other=0.0)
                    if n_ragged
                    else scale_ref[s_idx]
                )
                return w.astype(st.compute_dtype), s
            case WeightFormat.NVFP4 | WeightFormat.MXFP4:
                group = NVFP4_GROUP if st.fmt is WeightFormat.NVFP4 else MXFP4_GROUP
                kp, ks = bk // 2, bk // group  # packed bytes, scales per K step
                s_parts = list(mask_parts)
                if k_ragged:
                    s_parts.append((kb * ks + jnp.arange(ks) < st.k // group)[None, :])
                s_mask = functools.reduce(jnp.logical_and, s_parts) if s_parts else None
                packed = load_w_cols(g, h, kb, kp, st.k // 2)  # [bn, bk/2] uint8
                raw_s = masked_load(
                    scale_ref.at[w_index(g, h, pl.ds(n0, bn), pl.ds(kb * ks, ks))], s_mask
                )  # [bn, bk/group]
                # f16 e2m1 * 2^-14 of the even / odd k (two values per 32-bit op in PTX); the
                # 2^14 multiplies the accumulator once.
                lo, hi = fp4_to_f16_scaled(packed, st.inline_asm)  # [bn, bk/2] each
                if st.fmt is WeightFormat.NVFP4:  # e2m1 * 2^-14 * e4m3: exact in f16
                    s = raw_s.astype(jnp.float16)
                else:  # 2^(E-127) does not fit f16: scale in f32
                    s = e8m0_to_f32(raw_s.astype(jnp.int32))
                    lo, hi = lo.astype(jnp.float32), hi.astype(jnp.float32)
                s = _repeat_cols(s, group // 2)  # [bn, bk/2]: scale of byte j is s[j*2//group]
                # Exact in the dot dtype (<= 6 significant bits, within range), so the order of
                # the interleave and the cast does not matter.
                return _interleave_cols(lo * s, hi * s).astype(st.compute_dtype), None

    def compute(g):
        def body(kb, accs):
            k0 = pl.multiple_of(kb * bk, bk)
            x_mask = row_mask[:, None]
            if st.k % bk:
                x_mask = x_mask & (k0 + jnp.arange(bk) < st.k)[None, :]
            x = masked_load(x_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)], x_mask)
            x = x.astype(st.compute_dtype)  # no-op unless a W8A8 upcast or f32 weights
            x_s = None
            if st.w8a8:
                x_s = plgpu.load(
                    x_scale_ref.at[pl.ds(row0, bm), div(kb, FP8_ACT_GROUP // bk)],
                    mask=row_mask,
                    other=0.0,
                )  # [bm]
            precision = jax.lax.Precision.HIGHEST if st.compute_dtype == jnp.float32 else None
            new = []
            for h, acc in enumerate(accs):
                w, w_s = load_w(g, h, kb)
                a, b = (w, x) if st.swap_ab else (x, w)
                part = jax.lax.dot_general(
                    a,
                    b,
                    (((1,), (1,)), ((), ())),
                    precision=precision,
                    preferred_element_type=jnp.float32,
                )  # [bm, bn], or [bn, bm] with swap_ab
                if w_s is not None:
                    part = part * (w_s[:, None] if st.swap_ab else w_s[None, :])
                if x_s is not None:
                    part = part * (x_s[None, :] if st.swap_ab else x_s[:, None])
                new.append(acc + part)
            return tuple(new)

        zeros = jnp.zeros((bn, bm) if st.swap_ab else (bm, bn), jnp.float32)
        accs = jax.lax.fori_loop(0, pl.cdiv(st.k, bk), body, (zeros,) * st.halves)

        outs = []
        for h, acc in enumerate(accs):
            if st.swap_ab:
                acc = acc.T  # [bm, bn]
            if st.fmt in (WeightFormat.NVFP4, WeightFormat.MXFP4):
                acc = acc * F16_FP4_FACTOR  # fp4_to_f16_scaled's 2^-14
            if global_ref is not None:
                g_idx = (g, div(orig_rows(h), st.global_rows))
                gs = (
                    plgpu.load(global_ref.at[g_idx], mask=col_mask, other=0.0)
                    if n_ragged
                    else global_ref[g_idx]
                )
                acc = acc * gs[None, :]
            if bias_ref is not None:
                b_at = bias_ref.at[w_index(g, h, pl.ds(n0, bn))]
                b = masked_load(b_at, col_mask if n_ragged else None)
                acc = acc + b.astype(jnp.float32)[None, :]
            outs.append(acc)
        if st.activation is None:
            return outs[0]
        return _gated(outs[0], outs[1], st.activation, st.alpha, st.limit)

    @pl.when(seg < st.num_groups)
    def _():
        out = compute(seg)
        plgpu.store(out_slice, out.astype(o_ref.dtype), mask=out_mask)

    @pl.when(seg == st.num_groups)
    def _():  # padding rows past sum(group_sizes)
        plgpu.store(out_slice, jnp.zeros((bm, bn), o_ref.dtype), mask=out_mask)


# ---------------------------------------------------------------------------------------------
# Work list and pallas_call wrapper.
# ---------------------------------------------------------------------------------------------


def max_num_tiles(num_rows: int, num_groups: int, block_m: int) -> int:
    """Static upper bound of the row tiles of ``num_groups`` groups plus the padding segment."""
    return min(num_rows, pl.cdiv(num_rows, block_m) + num_groups)


def make_tile_table(
    group_sizes: jax.Array, *, num_rows: int, block_m: int, num_tiles: int
) -> jax.Array:
    """[3, num_tiles] int32 (segment, row start, row end) of each row tile, on device.

    Segments ``0..G-1`` are the groups, ``G`` the padding rows ``[sum, M)``, ``G+1`` marks idle
    entries past the real tile count (their rows are ``[M, M)``).
    """
    num_groups = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), num_rows)  # [G]
    m_arr = jnp.full((1,), num_rows, jnp.int32)
    seg_end = jnp.concatenate([ends, m_arr])  # [G+1]
    seg_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])  # [G+1]
    seg_tiles = (seg_end - seg_start + block_m - 1) // block_m  # [G+1]
    tile_end = jnp.cumsum(seg_tiles)  # [G+1]
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    seg = jnp.sum(tile_end[None, :] <= t[:, None], axis=1, dtype=jnp.int32)  # [T] in [0, G+1]
    seg_c = jnp.minimum(seg, num_groups)
    first = (tile_end - seg_tiles)[seg_c]
    idle = seg > num_groups
    row_start = jnp.where(idle, num_rows, seg_start[seg_c] + (t - first) * block_m)
    row_end = jnp.where(idle, num_rows, seg_end[seg_c])
    return jnp.stack([seg, row_start, row_end]).astype(jnp.int32)


def _grouped_matmul_pallas(
    tiles,  # [3, T] int32
    x,  # [M, K]
    x_scale,  # [M, cdiv(K, 128)] | None
    w,  # [G, H, N, Kw] | [G, N, 2, Kw]
    scale,  # format-specific (see grouped_matmul_kernel) | None
    global_scale,  # [G, R] | None
    bias,  # [G, H, N] | [G, N, 2] | None
    *,
    st: _Static,
    tile: TileConfig,
    out_dtype,
    interpret: bool,
) -> jax.Array:
    num_tiles = tiles.shape[1]
    grid = (num_tiles, pl.cdiv(st.n, tile.block_n))
    # No BlockSpecs: every operand is passed whole (a pointer in Triton) and the kernel indexes
    # it with the tile table, since row tiles start at data-dependent, unaligned rows.
    return pl.pallas_call(
        functools.partial(grouped_matmul_kernel, st=st),
        grid=grid,
        out_shape=jax.ShapeDtypeStruct((st.m, st.n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tile.num_warps, num_stages=tile.num_stages),
        interpret=interpret,
        name=(
            f"grouped_matmul_{st.fmt.value}_{'w8a8_' if st.w8a8 else ''}"
            f"{st.activation.value + '_' if st.activation else ''}"
            f"bm{tile.block_m}_bn{tile.block_n}_bk{tile.block_k}{'_swapab' if tile.swap_ab else ''}"
        ),
    )(tiles, x, x_scale, w, scale, global_scale, bias)


# ---------------------------------------------------------------------------------------------
# Public entry.
# ---------------------------------------------------------------------------------------------


def _expect_shape(name, arr, shape):
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(arr.shape)}")


def _expect_dtype(name, arr, dtypes):
    if arr.dtype not in [jnp.dtype(d) for d in dtypes]:
        allowed = ", ".join(str(jnp.dtype(d)) for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({allowed}), got {arr.dtype}")


@functools.partial(
    jax.jit,
    static_argnames=(
        "fmt",
        "activation",
        "gate_up_layout",
        "act_quant",
        "block_size",
        "fp8_dot",
        "alpha",
        "limit",
        "out_dtype",
        "tile",
        "interpret",
    ),
)
def grouped_matmul(
    x: jax.Array,  # [M, K] bf16/f16/f32, or e4m3 with x_scale (W8A8)
    w: jax.Array,  # [G, N, K] (BF16, FP8_BLOCK) | [G, N, K//2] u8 (NVFP4, MXFP4)
    group_sizes: jax.Array,  # [G] int32, rows of x per group (sorted by group)
    *,
    fmt: WeightFormat | str,
    scale: jax.Array | None = None,  # FP8 scale_inv | NVFP4 e4m3 [G,N,K/16] | MXFP4 u8 [G,N,K/32]
    global_scale: jax.Array | None = None,  # NVFP4 [G, R] or [G] f32
    bias: jax.Array | None = None,  # [G, N] per-group bias, added before the activation
    x_scale: jax.Array | None = None,  # [M, cdiv(K, 128)] f32 when x is e4m3
    activation: Activation | str | None = None,  # fused gate_up when set
    gate_up_layout: GateUpLayout | str = GateUpLayout.CONCATENATED,
    act_quant: ActivationQuant | str = ActivationQuant.NONE,
    block_size: tuple[int, int] = (128, 128),  # FP8_BLOCK scale block (b0 along N, b1 along K)
    fp8_dot: bool = False,  # W8A8: e4m3 x e4m3 tt.dot (True) or exact bf16 upcasts (False)
    alpha: float = GPT_OSS_ALPHA,
    limit: float = GPT_OSS_LIMIT,
    out_dtype=None,  # default: x.dtype (bf16 for e4m3 x)
    tile: TileConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Grouped matmul ``out[rows of g] = x[rows of g] @ dequant(w[g])^T``, f32 accumulation.

    Returns ``[M, N]``, or ``[M, N // 2]`` when ``activation`` fuses the gate_up epilogue
    (``act(gate) * up`` with gate/up split by ``gate_up_layout``). Padding rows past
    ``sum(group_sizes)`` come out as 0.

    Dot operands are in ``x.dtype`` (weights dequantized to it in registers), or e4m3 x e4m3 for
    W8A8: ``act_quant="fp8"`` quantizes a bf16/f32 ``x`` per token per 128 of K before the
    kernel (``quantize_activations_fp8``), or pass an e4m3 ``x`` with its ``x_scale``. Both
    scales multiply each K step's f32 dot. ``fp8_dot=False`` (default) upcasts the e4m3 tiles
    to bf16 in registers (exact) because Pallas' Triton lowering emits ``tt.dot`` without
    ``max_num_imprecise_acc``, so for e4m3 operands Triton on sm_90 refuses wgmma and falls
    back to f16 ``mma.sync``; the bf16 upcast keeps wgmma. ``fp8_dot=True`` emits the e4m3 dot.
    ``alpha``/``limit`` parametrize the gpt-oss activation. ``tile=None`` picks a tile with
    ``choose_tile_config`` from the shapes and the default device (SM count, device kind).
    ``interpret=True`` runs the Pallas interpreter (CPU tests).

    Raises ValueError/TypeError for malformed inputs and NotImplementedError for unsupported
    combinations (W8A8 on non-FP8 weights, an e4m3 ``x`` without W8A8, unsupported dtypes).
    """
    fmt = WeightFormat.coerce(fmt)
    act_quant = ActivationQuant.coerce(act_quant)
    activation = None if activation is None else Activation.coerce(activation)
    layout = GateUpLayout.coerce(gate_up_layout)

    # ---- unsupported combinations ----
    x_is_fp8 = x.dtype == jnp.float8_e4m3fn
    w8a8 = x_is_fp8 or act_quant is ActivationQuant.FP8
    if w8a8 and fmt is not WeightFormat.FP8_BLOCK:
        raise NotImplementedError(
            f"W8A8 (fp8 activations) is implemented for FP8_BLOCK weights only, got {fmt.value}"
        )
    if x_is_fp8 and x_scale is None:
        raise ValueError("x_scale: required when x is float8_e4m3fn (pre-quantized W8A8)")
    if not x_is_fp8 and x_scale is not None:
        raise ValueError(f"x_scale: only used when x is float8_e4m3fn, but x is {x.dtype}")
    if not x_is_fp8 and x.dtype not in [jnp.dtype(d) for d in _X_DTYPES]:
        raise NotImplementedError(
            f"x: dtype {x.dtype} not supported (bf16, f16, f32, or e4m3 for W8A8)"
        )
    if out_dtype is None:
        out_dtype = jnp.bfloat16 if x_is_fp8 else x.dtype
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in [jnp.dtype(d) for d in _OUT_DTYPES]:
        raise NotImplementedError(f"out_dtype: {out_dtype} not supported (bf16, f16, f32)")

    # ---- shapes ----
    if (
        not isinstance(block_size, tuple)
        or len(block_size) != 2
        or not all(isinstance(b, int) and b > 0 for b in block_size)
    ):
        raise ValueError(f"block_size: expected a tuple of two positive ints, got {block_size!r}")
    if x.ndim != 2:
        raise ValueError(f"x: expected rank 2 [M, K], got shape {x.shape}")
    m, k = x.shape
    if w.ndim != 3:
        raise ValueError(f"w: expected rank 3 [G, N, K(/2)], got shape {w.shape}")
    num_groups, n_w, k_w = w.shape
    _expect_shape("group_sizes", group_sizes, (num_groups,))
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes: expected an integer dtype, got {group_sizes.dtype}")
    global_rows = n_w
    match fmt:
        case WeightFormat.BF16:
            _expect_dtype("w", w, (jnp.bfloat16, jnp.float16, jnp.float32))
            _expect_shape("w", w, (num_groups, n_w, k))
            if scale is not None:
                raise ValueError("scale: BF16 weights take no scale")
        case WeightFormat.FP8_BLOCK:
            _expect_dtype("w", w, (jnp.float8_e4m3fn,))
            _expect_shape("w", w, (num_groups, n_w, k))
            if scale is None:
                raise ValueError("scale: FP8_BLOCK needs scale_inv [G, cdiv(N,b0), cdiv(K,b1)]")
            b0, b1 = block_size
            _expect_shape("scale", scale, (num_groups, pl.cdiv(n_w, b0), pl.cdiv(k, b1)))
            scale = scale.astype(jnp.float32)
        case WeightFormat.NVFP4 | WeightFormat.MXFP4:
            group = NVFP4_GROUP if fmt is WeightFormat.NVFP4 else MXFP4_GROUP
            if k % group:
                raise ValueError(f"x: {fmt.value} needs K to be a multiple of {group}, got K={k}")
            _expect_dtype("w", w, (jnp.uint8,))
            _expect_shape("w", w, (num_groups, n_w, k // 2))
            if scale is None:
                raise ValueError(f"scale: {fmt.value} needs scale [G, N, K/{group}]")
            _expect_dtype(
                "scale", scale, (jnp.float8_e4m3fn,) if fmt is WeightFormat.NVFP4 else (jnp.uint8,)
            )
            _expect_shape("scale", scale, (num_groups, n_w, k // group))
    if fmt is WeightFormat.NVFP4:
        if global_scale is None:
            global_scale = jnp.ones((num_groups, 1), jnp.float32)
        global_scale = global_scale.astype(jnp.float32).reshape(num_groups, -1)  # [G, R]
        r = global_scale.shape[1]
        if n_w % r:
            raise ValueError(f"global_scale: R={r} row segments must divide N={n_w}")
        global_rows = n_w // r
    elif global_scale is not None:
        raise ValueError(f"global_scale: only NVFP4 has a global scale, fmt is {fmt.value}")
    if bias is not None:
        _expect_shape("bias", bias, (num_groups, n_w))
    halves = 1
    if activation is not None:
        if n_w % 2:
            raise ValueError(f"w: a fused gate_up needs an even N = 2I, got N={n_w}")
        halves = 2
    n = n_w // halves
    if m == 0:
        return jnp.zeros((0, n), out_dtype)

    # ---- tile ----
    if tile is None:
        tile = tuned_tile_config(device_kind(), tuned_key(
            m, n, k, num_groups, fmt, fused_gate_up=halves == 2,
            act_quant=ActivationQuant.FP8 if w8a8 else ActivationQuant.NONE))
    if tile is None:
        tile = choose_tile_config(
            m,
            n,
            k,
            num_groups,
            fmt,
            fused_gate_up=halves == 2,
            act_quant=ActivationQuant.FP8 if w8a8 else ActivationQuant.NONE,
            fp8_block=block_size,
            x_itemsize=x.dtype.itemsize,
            sm_count=device_sm_count(),
            device_kind=device_kind(),
        )
    tile.check_format(
        fmt,
        fp8_block=block_size,
        act_quant=ActivationQuant.FP8 if w8a8 else ActivationQuant.NONE,
    )

    # ---- activations (W8A8: per token per 128 of K, outside the kernel: one pass over x) ----
    if w8a8 and not x_is_fp8:
        x, x_scale = quantize_activations_fp8(x)
    if w8a8:
        _expect_shape("x_scale", x_scale, (m, pl.cdiv(k, FP8_ACT_GROUP)))
        x_scale = x_scale.astype(jnp.float32)
    compute_dtype = (jnp.float8_e4m3fn if fp8_dot else jnp.bfloat16) if w8a8 else x.dtype

    # ---- free reshapes that expose the gate/up halves as an axis ----
    def split_rows(a):  # [G, H*N, ...] -> [G, H, N, ...] or [G, N, 2, ...]
        if a is None:
            return None
        if layout is GateUpLayout.INTERLEAVED and halves == 2:
            return a.reshape(num_groups, n, 2, *a.shape[2:])
        return a.reshape(num_groups, halves, n, *a.shape[2:])

    w4 = split_rows(w)
    scale_k = scale if fmt is WeightFormat.FP8_BLOCK else split_rows(scale)
    bias3 = split_rows(bias)
    w4, w_pairs = pair_view_if_overflowing("w", w4)
    check_offsets(dict(x=x, x_scale=x_scale, w=w4, scale=scale_k, global_scale=global_scale,
                        bias=bias3))

    st = _Static(
        fmt=fmt,
        halves=halves,
        layout=layout if halves == 2 else GateUpLayout.CONCATENATED,
        activation=activation,
        w8a8=w8a8,
        num_groups=num_groups,
        m=m,
        n=n,
        k=k,
        block_m=tile.block_m,
        block_n=tile.block_n,
        block_k=tile.block_k,
        swap_ab=tile.swap_ab,
        fp8_block=tuple(block_size),
        global_rows=global_rows,
        compute_dtype=jnp.dtype(compute_dtype),
        inline_asm=not interpret,
        w_pairs=w_pairs,
        alpha=float(alpha),
        limit=float(limit),
    )
    num_tiles = max_num_tiles(m, num_groups, tile.block_m)
    tiles = make_tile_table(
        group_sizes, num_rows=m, block_m=tile.block_m, num_tiles=num_tiles
    )  # [3, T]
    return _grouped_matmul_pallas(
        tiles,
        x,
        x_scale,
        w4,
        scale_k,
        global_scale,
        bias3,
        st=st,
        tile=tile,
        out_dtype=out_dtype,
        interpret=interpret,
    )
