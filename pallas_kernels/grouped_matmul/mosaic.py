"""BF16 grouped matmul on the Mosaic GPU Pallas backend, written for Hopper (sm_90).

``out[M, N] = x[M, K] @ W[g]^T`` over rows sorted by group, the same contract as
``kernel.grouped_matmul`` (BF16 weights only): rows past ``sum(group_sizes)`` are padding and come
out as 0, every output row is written exactly once.

Structure. A persistent kernel: one CTA per SM walks the work list ``(row tile, n tile)``, with
the row tiles of ``kernel.make_tile_table`` (computed on device from ``group_sizes``: each tile
owns rows ``[row0, min(row0 + block_m, segment end))`` of one segment). Each CTA has three
warpgroups: the last one only issues TMA copies (x tile ``[block_m, block_k]`` and W tile
``[block_n, block_k]`` into 128-byte-swizzled SMEM, ``num_stages`` deep), the two others each own
half of the tile's columns and run wgmma into an f32 accumulator
(``plgpu.emit_pipeline_warp_specialized``). The producer runs ahead into the next work item's K
loop while the consumers write the epilogue.

Ragged rows. A work-list tile starts at any row, but Mosaic GPU's TMA into tiled (8-row) SMEM
needs the first row to be a multiple of 8, so the work list is cut into tiles of
``block_m - 8`` rows and the ``block_m``-row x tile is read from ``row0`` rounded down to a
multiple of 8 (clamped to ``M_pad - block_m``; rows of the neighbouring segment ride along and
are discarded). Cost: up to 8 of the 128 MMA rows of a full tile are wasted. The last column
tile is shifted left to ``N - block_n`` (its overlap with the previous tile is recomputed and
rewritten with the same values). Stores must not
touch rows the tile does not own (a neighbouring group's tile writes them), and a TMA box has a
static shape, so the epilogue goes through an unswizzled SMEM buffer and stores the tile's rows
as one TMA store per set bit of the row count (64, 32, ..., 1 rows: at most ``log2(block_m)``
stores). Padding tiles store zeros the same way.

The fused gate_up variant (``activation`` set, concatenated ``[gate; up]`` rows of
``W [G, 2I, K]``) loads a gate and an up W tile per K step, keeps two accumulators per consumer
warpgroup and writes only ``act(gate) * up``.

Unsupported (``NotImplementedError``): non-bf16 x or W, the interleaved gate_up layout, a bias,
``N % 8`` (TMA needs 16-byte row strides), ``K`` not a multiple of ``block_k`` (16 at least),
``N < block_n``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._device import device_sm_count
from pallas_kernels.grouped_matmul.config import Activation
from pallas_kernels.grouped_matmul.kernel import make_tile_table, max_num_tiles
from pallas_kernels.grouped_matmul.reference import GPT_OSS_ALPHA, GPT_OSS_LIMIT

_SQRT_2_OVER_PI = 0.7978845608028654
_NUM_CONSUMERS = 2  # consumer warpgroups per CTA; each owns block_n / 2 columns
_ROW_ALIGN = 8  # a TMA load into tiled SMEM starts at a multiple of 8 rows
_SMEM_BYTES = 227 * 1024  # opt-in shared memory per block on sm_90
_OUT_DTYPES = (jnp.bfloat16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class MosaicTileConfig:
    """Tile of one CTA of the Mosaic GPU grouped matmul.

    ``block_n`` counts the CTA's output columns (the two consumer warpgroups take half each; with
    a fused gate_up each half holds a gate and an up accumulator). ``epilogue_n`` columns go
    through SMEM per TMA store step. ``grid_sms`` overrides the persistent grid size (None: the
    device's SM count).
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_stages: int = 4
    epilogue_n: int = 64
    grid_sms: int | None = None

    def __post_init__(self):
        def pow2(v):
            return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0

        if not pow2(self.block_m) or not 64 <= self.block_m <= 256:
            raise ValueError(
                f"MosaicTileConfig.block_m: expected 64, 128 or 256, got {self.block_m!r}")
        if not pow2(self.block_n) or not 32 <= self.block_n <= 512:
            raise ValueError(
                f"MosaicTileConfig.block_n: expected a power of two in [32, 512], "
                f"got {self.block_n!r}")
        if self.block_k not in (16, 32, 64):
            raise ValueError(
                f"MosaicTileConfig.block_k: expected 16, 32 or 64 (one swizzle row), "
                f"got {self.block_k!r}")
        if not isinstance(self.num_stages, int) or not 2 <= self.num_stages <= 8:
            raise ValueError(
                f"MosaicTileConfig.num_stages: expected an int in [2, 8], got {self.num_stages!r}")
        if not pow2(self.epilogue_n) or self.epilogue_n > self.block_n // _NUM_CONSUMERS:
            raise ValueError(
                f"MosaicTileConfig.epilogue_n: expected a power of two <= block_n / "
                f"{_NUM_CONSUMERS} = {self.block_n // _NUM_CONSUMERS}, got {self.epilogue_n!r}")
        if self.grid_sms is not None and (not isinstance(self.grid_sms, int) or self.grid_sms < 1):
            raise ValueError(
                f"MosaicTileConfig.grid_sms: expected None or a positive int, "
                f"got {self.grid_sms!r}")

    def smem_bytes(self, halves: int, out_itemsize: int) -> int:
        """Shared memory of the pipeline stages plus the epilogue buffers."""
        stage = (self.block_m + halves * self.block_n) * self.block_k * 2
        return self.num_stages * stage + _NUM_CONSUMERS * self.block_m * self.epilogue_n * (
            out_itemsize)


def choose_mosaic_tile_config(n: int, k: int = 64, *, fused_gate_up: bool = False,
                              out_itemsize: int = 2) -> MosaicTileConfig:
    """Pure heuristic: 128 rows x 256 columns (128 x 128 of gate and up when fused), K steps of
    64 (32 or 16 when they divide K and 64 does not), as many stages as shared memory holds (2 to
    4), column tiles halved while N < block_n."""
    block_k = next((b for b in (64, 32) if k % b == 0), 16)
    halves = 2 if fused_gate_up else 1
    block_n = 256 // halves
    while block_n > 32 and n < block_n:
        block_n //= 2
    epilogue_n = max(128 // out_itemsize, 16) if block_n >= 2 * 128 // out_itemsize else (
        block_n // _NUM_CONSUMERS)
    tile = MosaicTileConfig(block_m=128, block_n=block_n, block_k=block_k,
                            epilogue_n=epilogue_n, num_stages=2)
    for stages in (4, 3):
        candidate = dataclasses.replace(tile, num_stages=stages)
        if candidate.smem_bytes(halves, out_itemsize) <= _SMEM_BYTES - 1024:
            return candidate
    return tile


def _gated(gate, up, activation: Activation, alpha: float, limit: float):
    """``act(gate) * up`` in f32 from primitives Mosaic GPU lowers (no ``logistic``)."""

    def sigmoid(v):
        return 1.0 / (1.0 + jnp.exp(-v))

    match activation:
        case Activation.SILU:
            return gate * sigmoid(gate) * up
        case Activation.GELU_TANH:
            inner = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
            return 0.5 * gate * (1.0 + jnp.tanh(inner)) * up
        case Activation.GPT_OSS:
            g = jnp.minimum(gate, limit)
            u = jnp.minimum(jnp.maximum(up, -limit), limit)
            return (u + 1.0) * g * sigmoid(alpha * g)


# ---------------------------------------------------------------------------------------------
# Kernel body.
# ---------------------------------------------------------------------------------------------


def _kernel(
    tiles_gmem,  # [3, T] int32: segment (G = padding rows, G+1 = idle), row start, row end
    x_gmem,  # [Mp, K] bf16, Mp = max(M rounded up to 8, block_m)
    w_gmem,  # [G, H, N, K] bf16 (H = 1 plain, 2 fused gate_up)
    o_gmem,  # [Mp, N] out dtype
    *,
    tile: MosaicTileConfig,
    num_groups: int,
    activation: Activation | None,
    alpha: float,
    limit: float,
):
    bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
    rows = bm - _ROW_ALIGN  # rows per work-list tile
    bn_wg = bn // _NUM_CONSUMERS
    epi_n = tile.epilogue_n
    m_pad, k = x_gmem.shape
    _, halves, n, _ = w_gmem.shape
    num_tiles = tiles_gmem.shape[1]
    n_tiles = pl.cdiv(n, bn)
    out_dtype = o_gmem.dtype

    swizzle = plgpu.find_swizzle(bk * 16)  # bits of one bf16 K row of the tile
    transforms = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
    spec = functools.partial(plgpu.BlockSpec, transforms=transforms,
                             memory_space=plgpu.SMEM, delay_release=1)
    in_specs = [spec((bm, bk), lambda kb: (0, kb))] + [
        spec((bn, bk), lambda kb: (0, kb)) for _ in range(halves)]

    def get_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(pl.cdiv(k, bk),),
            memory_registers=40,
            in_specs=in_specs,
            wg_axis="wg",
            num_compute_wgs=_NUM_CONSUMERS,
            max_concurrent_steps=tile.num_stages,
            compute_context=compute_context,
        )

    def store_rows(o_smem, row0, num_rows, smem_row0, col0):
        """TMA-stores rows ``[smem_row0, smem_row0 + num_rows)`` of ``o_smem [bm, epi_n]`` to
        rows ``[row0, row0 + num_rows)``, columns ``[col0, col0 + epi_n)``: one store per set
        bit of ``num_rows`` (a TMA box has a static shape; no row outside the range is touched).
        """
        def store(offset, size):
            @pl.when(num_rows & size != 0)
            def _():
                plgpu.copy_smem_to_gmem(
                    o_smem.at[pl.ds(smem_row0 + offset, size)],
                    o_gmem.at[pl.ds(row0 + offset, size), pl.ds(col0, epi_n)],
                )

        done = jnp.int32(0)
        size = bm // 2  # num_rows <= bm - 8
        while size >= 1:
            store(done, size)
            done = done + (num_rows & size)
            size //= 2

    def epilogue(o_smem, out, row0, num_rows, smem_row0, col0):
        """Writes ``out [bm, bn_wg]`` (f32 values or None for zeros) through ``o_smem``."""
        for c in range(bn_wg // epi_n):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # o_smem free again
            if out is None:
                o_smem[...] = jnp.zeros((bm, epi_n), out_dtype)
            else:
                o_smem[...] = out[:, c * epi_n:(c + 1) * epi_n].astype(out_dtype)
            plgpu.commit_smem()
            store_rows(o_smem, row0, num_rows, smem_row0, col0 + c * epi_n)

    ignore = lambda *_, **__: None  # noqa: E731 (allocations do not depend on the body)
    w_view = w_gmem.at[0, 0, pl.ds(0, bn)]

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(
            x_gmem.at[pl.ds(0, bm)], *([w_view] * halves)),
        o_smem=plgpu.SMEM((_NUM_CONSUMERS, bm, epi_n), out_dtype),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, o_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((num_tiles * n_tiles,), collective_axes="sm")
        def _work_loop(info):
            (lin,) = info.index
            t = lax.div(lin, jnp.int32(n_tiles))
            ni = lax.rem(lin, jnp.int32(n_tiles))
            seg = tiles_gmem[0, t]
            row0 = tiles_gmem[1, t]
            num_rows = jnp.minimum(tiles_gmem[2, t] - row0, rows)  # row end is the segment's
            # x tile from a multiple of 8 (the SMEM tiling), inside x (m_pad - bm is one too)
            load_row0 = pl.multiple_of(jnp.minimum(row0 - lax.rem(row0, 8), m_pad - bm), 8)
            smem_row0 = row0 - load_row0
            # last column tile shifted left to stay inside W (n and bn are multiples of 8)
            n0 = pl.multiple_of(jnp.minimum(ni * bn, n - bn), 8)
            col0 = n0 + wg * bn_wg  # this consumer's first column

            def compute_context(eval_pipeline):
                accs = tuple(plgpu.ACC((bm, bn_wg), jnp.float32) for _ in range(halves))

                @functools.partial(pl.run_scoped, accs=accs)
                def _acc_scope(accs):
                    eval_pipeline(accs)
                    vals = [acc[...] for acc in accs]
                    out = vals[0] if activation is None else _gated(
                        vals[0], vals[1], activation, alpha, limit)
                    epilogue(o_smem.at[wg], out, row0, num_rows, smem_row0, col0)

            def mma_body(_, x_smem, *rest):
                *w_smems, accs = rest
                for w_smem, acc in zip(w_smems, accs, strict=True):
                    w_wg = w_smem.at[pl.ds(wg * bn_wg, bn_wg)]  # [bn_wg, bk]
                    plgpu.wgmma(acc, x_smem, w_wg.transpose((1, 0)))
                plgpu.wgmma_wait(1)  # the previous step's wgmma is done: its stage is released
                return accs

            @pl.when(seg < num_groups)
            def _():
                w_tiles = [w_gmem.at[seg, h, pl.ds(n0, bn)] for h in range(halves)]
                get_pipeline(mma_body, compute_context)(
                    x_gmem.at[pl.ds(load_row0, bm)], *w_tiles, allocations=pipeline_allocs)

            @pl.when((seg == num_groups) & (wg < _NUM_CONSUMERS))
            def _():  # padding rows past sum(group_sizes)
                epilogue(o_smem.at[wg], None, row0, num_rows, smem_row0, col0)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


# ---------------------------------------------------------------------------------------------
# plgpu.kernel wrapper and public entry.
# ---------------------------------------------------------------------------------------------


def _grouped_matmul_mosaic(tiles, x, w4, *, tile, num_groups, activation, alpha, limit,
                           out_dtype, interpret):
    m_pad = x.shape[0]
    n = w4.shape[2]
    num_sms = tile.grid_sms or device_sm_count() or 4
    kernel = plgpu.kernel(
        functools.partial(_kernel, tile=tile, num_groups=num_groups, activation=activation,
                          alpha=alpha, limit=limit),
        out_type=jax.ShapeDtypeStruct((m_pad, n), out_dtype),
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=_NUM_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return kernel(tiles, x, w4)


def unsupported_reason(x_dtype, w_dtype, n: int, k: int, *, fused_gate_up: bool = False,
                       gate_up_layout: str = "concatenated", out_dtype=jnp.float32,
                       bias: bool = False, tile: MosaicTileConfig | None = None) -> str | None:
    """Why the Mosaic GPU kernel cannot run this problem (``n`` output columns per half), or
    None when it can: the one list of its limits, raised by ``grouped_matmul_mosaic`` and read
    by callers that pick between kernels."""
    out_dtype = jnp.dtype(out_dtype)
    if bias:
        return "bias: the Mosaic GPU kernel has no bias epilogue"
    if fused_gate_up and gate_up_layout != "concatenated":
        return (f"gate_up_layout: the Mosaic GPU kernel reads concatenated [gate; up] rows only, "
                f"got {gate_up_layout!r}")
    for name, dtype in (("x", x_dtype), ("w", w_dtype)):
        if jnp.dtype(dtype) != jnp.bfloat16:
            return f"{name}: the Mosaic GPU kernel is bf16 only, got dtype {jnp.dtype(dtype)}"
    if out_dtype not in [jnp.dtype(d) for d in _OUT_DTYPES]:
        return f"out_dtype: {out_dtype} not supported (bf16, f32)"
    if k % 8:
        return f"x: K={k} must be a multiple of 8 (TMA needs 16-byte row strides)"
    if n % 8:
        return f"w: N={n} output columns must be a multiple of 8 (TMA needs 16-byte row strides)"
    if tile is None:
        tile = choose_mosaic_tile_config(n, k, fused_gate_up=fused_gate_up,
                                         out_itemsize=out_dtype.itemsize)
    if k % tile.block_k:
        return (f"x: K={k} must be a multiple of block_k={tile.block_k} (Mosaic GPU views x and "
                f"W in GMEM tiled like their SMEM tiles; a partial K tile does not lower)")
    if n < tile.block_n:
        return (f"w: N={n} output columns is less than block_n={tile.block_n} (the last column "
                f"tile is shifted left to stay inside W)")
    if tile.epilogue_n * out_dtype.itemsize % 128:
        return (f"tile.epilogue_n: {tile.epilogue_n} columns of {out_dtype} are not a multiple "
                f"of 128 bytes (TMA stores start at any row of the epilogue buffer)")
    return None


@functools.partial(
    jax.jit,
    static_argnames=("activation", "gate_up_layout", "alpha", "limit", "out_dtype", "tile",
                     "interpret"),
)
def grouped_matmul_mosaic(
    x: jax.Array,  # [M, K] bf16
    w: jax.Array,  # [G, N, K] bf16 ([G, 2I, K] with a fused gate_up)
    group_sizes: jax.Array,  # [G] int32, rows of x per group (sorted by group)
    *,
    activation: Activation | str | None = None,  # fused gate_up when set
    gate_up_layout: str = "concatenated",
    alpha: float = GPT_OSS_ALPHA,
    limit: float = GPT_OSS_LIMIT,
    out_dtype=None,  # bf16 (default: x.dtype) or f32
    tile: MosaicTileConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """BF16 grouped matmul ``out[rows of g] = x[rows of g] @ w[g]^T`` (f32 accumulation) with
    Mosaic GPU: TMA, wgmma, warp specialization, a persistent grid over the tile work list.

    Returns ``[M, N]``, or ``[M, N // 2]`` with ``activation`` (``act(gate) * up``, gate rows
    ``[0, I)`` and up rows ``[I, 2I)`` of ``w``). Padding rows past ``sum(group_sizes)`` come out
    as 0. ``interpret=True`` runs the Mosaic GPU interpreter (CPU tests).
    """
    activation = None if activation is None else Activation.coerce(activation)
    if x.ndim != 2:
        raise ValueError(f"x: expected rank 2 [M, K], got shape {x.shape}")
    if w.ndim != 3:
        raise ValueError(f"w: expected rank 3 [G, N, K], got shape {w.shape}")
    m, k = x.shape
    num_groups, n_w, k_w = w.shape
    if k_w != k:
        raise ValueError(f"w: expected shape ({num_groups}, {n_w}, {k}), got {w.shape}")
    if group_sizes.shape != (num_groups,):
        raise ValueError(
            f"group_sizes: expected shape ({num_groups},), got {tuple(group_sizes.shape)}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes: expected an integer dtype, got {group_sizes.dtype}")
    halves = 1 if activation is None else 2
    if n_w % halves:
        raise ValueError(f"w: a fused gate_up needs an even N = 2I, got N={n_w}")
    n = n_w // halves
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    reason = unsupported_reason(x.dtype, w.dtype, n, k, fused_gate_up=halves == 2,
                                gate_up_layout=gate_up_layout, out_dtype=out_dtype, tile=tile)
    if reason:
        raise NotImplementedError(reason)
    if tile is None:
        tile = choose_mosaic_tile_config(n, k, fused_gate_up=halves == 2,
                                         out_itemsize=out_dtype.itemsize)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)

    # Rows padded to a multiple of 8 and to at least one x tile (no copy for MoE shapes:
    # M = tokens * top_k is a multiple of 8 for top_k = 8).
    m_pad = max(-(-m // _ROW_ALIGN) * _ROW_ALIGN, tile.block_m)
    x_p = jnp.pad(x, ((0, m_pad - m), (0, 0))) if m_pad > m else x
    rows = tile.block_m - _ROW_ALIGN
    tiles = make_tile_table(group_sizes, num_rows=m, block_m=rows,
                            num_tiles=max_num_tiles(m, num_groups, rows))  # [3, T]
    out = _grouped_matmul_mosaic(
        tiles, x_p, w.reshape(num_groups, halves, n, k), tile=tile, num_groups=num_groups,
        activation=activation, alpha=float(alpha), limit=float(limit), out_dtype=out_dtype,
        interpret=interpret)
    return out[:m] if m_pad > m else out
