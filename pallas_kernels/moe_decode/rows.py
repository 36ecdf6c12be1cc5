"""The Mosaic GPU decode kernels' f16 activation rows, one Pallas launch each (Triton lowering).

``mosaic.slot_matmul`` takes the rows of its activations in sorted-row order, in f16, each row
scaled by a power of two into f16 range (``_pow2_row_scales``: exact for bf16 inputs), FP4
launches also in the operand column order (``mosaic.fp4_operand_order``). Two launches make
them, one program a row, where XLA took two and three small fusions (a row amax is a
reduction, the scaled copy its consumer; each a launch of ~1-1.5 us on the H200):

- ``x_rows``: row r is token ``token_of_row[r]``'s row of x (rows past the P pairs: token 0's;
  with ``padding``, token -1: a padding row, left unwritten).
- ``plan_x_rows``: up to ``PLAN_X_ROWS_MAX_PAIRS`` pairs (1-8 tokens of top-8), the decode
  plan and x's rows in one launch: program 0 stores the plan (``make_plan``'s Pallas kernel),
  every other program recomputes the pairs' sorted rows (up to 4096 comparisons) to find its
  row's token.
- ``h_rows``: row r of the gate_up launch's output (its K-split partials summed; x's factor
  and the gate_up bias are in that launch's epilogue), ``act(gate) * up`` rounded to bf16 (as
  the Triton path stores h), then scaled like x.

Each returns ``(rows [R, K] f16, factor [R] f32)``: ``rows * factor`` is the row as computed.
A program loads its row in the order it stores it (the operand order for FP4: a gather from
L2), so no permutation happens in registers. ``rows_reference`` states both in jnp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.grouped_matmul.config import Activation, GateUpLayout
from pallas_kernels.grouped_matmul.reference import GPT_OSS_ALPHA
from pallas_kernels.moe_decode.kernel import (
    PALLAS_PLAN_MAX_PAIRS,
    DecodePlan,
    _epilogue,
    _pair_rows,
    _plan_call,
    _plan_kernel,
    _radix_plan_kernel,
)
from pallas_kernels.paged_attention.decode import _pow2_row_scales


def operand_source(pos, block_k: int):
    """K column each position of a row feeds in the FP4 operand order (``pos``: int32 array of
    positions in ``[0, K)``, K a multiple of ``block_k``): within a step, position ``16 (2w +
    hh) + 8j + 2c + q`` takes column ``c block_k / 4 + 8w + 4j + 2q + hh``
    (``mosaic._to_operand_order``). Integer ops, so a kernel can compute it."""
    step, q = pos // block_k * block_k, pos % block_k
    o, within = q // 16, q % 16
    w, hh = o // 2, o % 2
    j, c, qq = within // 8, within % 8 // 2, within % 2
    return step + c * (block_k // 4) + 8 * w + 4 * j + 2 * qq + hh


def row_width(k: int, block_k: int | None) -> int:
    """A row of ``k`` columns as stored: ``k``, or in the FP4 operand order for steps of
    ``block_k`` padded to whole steps (a ragged K: ``mosaic.FP4_RAGGED_STEP``)."""
    return k if block_k is None else -(-k // block_k) * block_k


def _columns(k: int, block_k: int | None):
    """(position, source column, stored, loaded) of a row of ``k`` columns stored
    ``row_width`` wide, the positions padded to a power of two: ``stored`` the row's
    positions, ``loaded`` those whose source column is inside K (the others store 0)."""
    width = row_width(k, block_k)
    pos = jnp.arange(pl.next_power_of_2(width), dtype=jnp.int32)
    stored = pos < width
    src = pos if block_k is None else operand_source(pos, block_k)
    loaded = stored if width == k else stored & (src < k)
    return pos, jnp.where(loaded, src, 0), stored, loaded


def _round_to_bf16(v):
    """f32 -> the nearest bf16 (ties to even), kept f32, by integer ops on the bits: XLA on the
    GPU may drop a convert pair ``f32 -> bf16 -> f32`` (excess precision), which in interpret
    mode would skip the rounding the compiled kernel does. Infinities stay; NaN stays NaN (the
    carry of a NaN's payload could reach the sign bit, so NaN is passed through)."""
    bits = jax.lax.bitcast_convert_type(v, jnp.int32)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & jnp.int32(-65536)  # -65536: 0xFFFF0000
    return jnp.where(v == v, jax.lax.bitcast_convert_type(bits, jnp.float32), v)


def _store_scaled(rows_ref, factor_ref, r, v, pos, valid):
    """Row ``r`` of f32 values ``v`` (0 off the row) as f16 scaled by a power of two."""
    up, down = _pow2_row_scales(jnp.max(jnp.abs(v))[None])
    plgpu.store(rows_ref.at[r, pos], (v * up).astype(jnp.float16), mask=valid)
    plgpu.store(factor_ref.at[pl.ds(r, 1)], down)


def _store_x_row(x_ref, rows_ref, factor_ref, r, token, block_k: int | None):
    """Row ``r`` of the rows: token ``token``'s row of x, scaled into f16."""
    pos, src, stored, loaded = _columns(x_ref.shape[1], block_k)
    v = plgpu.load(x_ref.at[token, src], mask=loaded, other=0.0).astype(jnp.float32)
    _store_scaled(rows_ref, factor_ref, r, v, pos, stored)


def _x_rows_kernel(token_ref, x_ref, rows_ref, factor_ref, *, p: int, block_k: int | None,
                   padding: bool):
    r = pl.program_id(0)
    token = jnp.where(r < p, token_ref[jnp.minimum(r, p - 1)], 0)

    def store():
        _store_x_row(x_ref, rows_ref, factor_ref, r, token, block_k)

    if padding:  # -1: a padding row (kernel.blocked_plan), not stored
        pl.when(token >= 0)(store)
    else:
        store()


def _plan_x_rows_kernel(ids_ref, x_ref, work_ref, token_of_row_ref, row_of_pair_ref, items_ref,
                        rows_ref, factor_ref, *, p: int, k: int, num_experts: int,
                        item_rows: int, block_k: int | None, plan):
    """Program 0 stores the plan (``plan``: ``kernel._plan_kernel`` or
    ``kernel._radix_plan_kernel``); program r + 1 finds the pairs' sorted rows by pairwise
    comparisons (``_pair_rows``), the pair at row r gives its token (rows past ``p``: token 0),
    whose x row it stores."""
    r = pl.program_id(0) - 1

    @pl.when(r < 0)
    def _():
        plan(ids_ref, work_ref, token_of_row_ref, row_of_pair_ref, items_ref, p=p, k=k,
             num_experts=num_experts, item_rows=item_rows)

    @pl.when(r >= 0)
    def _():
        idx, valid, *_, row = _pair_rows(ids_ref, p, num_experts)
        token = jnp.sum(jnp.where(valid & (row == r), jax.lax.div(idx, jnp.int32(k)), 0))
        _store_x_row(x_ref, rows_ref, factor_ref, r, token, block_k)


def _h_rows_kernel(gu_ref, rows_ref, factor_ref, *, rows: int, splits: int,
                   layout: GateUpLayout, activation: Activation, limit: float | None,
                   alpha: float, block_k: int | None):
    r = pl.program_id(0)
    inter = gu_ref.shape[1] // 2
    pos, src, stored, loaded = _columns(inter, block_k)
    interleaved = layout is GateUpLayout.INTERLEAVED
    cols = (2 * src, 2 * src + 1) if interleaved else (src, src + inter)

    def part(c):  # the gate or up columns of row r, split partials summed
        v = plgpu.load(gu_ref.at[r, c], mask=loaded, other=0.0)
        for s in range(1, splits):
            v = v + plgpu.load(gu_ref.at[s * rows + r, c], mask=loaded, other=0.0)
        return v

    h = _epilogue(part(cols[0]), part(cols[1]), activation, limit, alpha)
    h = jnp.where(loaded, _round_to_bf16(h), 0.0)
    _store_scaled(rows_ref, factor_ref, r, h, pos, stored)


# Row elements a warp of a row program: gpt-oss's rows of 2880 (padded to 4096) and wider take
# 8 warps, rows up to 2048 4 (H200: NOTES session 19; 4 and 8 are the counts timed).
ROW_ELEMENTS_PER_WARP = 512


def row_warps(k: int) -> int:
    """Warps of a program that makes one row of ``k`` (padded to a power of two): 4 or 8."""
    return min(8, max(4, pl.next_power_of_2(k) // ROW_ELEMENTS_PER_WARP))


def _launch(kernel, rows: int, width: int, args, interpret: bool, name: str):
    return pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((rows, width), jnp.float16),
                   jax.ShapeDtypeStruct((rows,), jnp.float32)],
        grid=(rows,),
        compiler_params=plgpu.CompilerParams(num_warps=row_warps(width), num_stages=1),
        interpret=interpret,
        name=name,
    )(*args)


def x_rows(x: jax.Array, token_of_row: jax.Array, rows: int, *, block_k: int | None = None,
           padding: bool = False, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """``x [T, H]`` -> (``rows`` f16 rows in sorted order, their factors): row r is token
    ``token_of_row[r]``'s (past ``len(token_of_row)``: token 0's); ``block_k``: FP4 operand
    order for K steps of that length (``row_width`` wide); ``padding``: rows of token -1 are
    padding (a blocked plan's), left unwritten."""
    p = token_of_row.shape[0]
    kernel = functools.partial(_x_rows_kernel, p=p, block_k=block_k, padding=padding)
    return _launch(kernel, rows, row_width(x.shape[1], block_k),
                   (token_of_row.astype(jnp.int32), x), interpret, "moe_decode_x_rows")


# Up to this many pairs (8 tokens of top-8) the decode step's plan and x rows are one launch
# (``plan_x_rows``): each row's program finds its token by [P, P] pairwise comparisons.
PLAN_X_ROWS_MAX_PAIRS = 64


def plan_x_rows(x: jax.Array, expert_ids: jax.Array, num_experts: int, rows: int, *,
                item_rows: int, block_k: int | None = None,
                interpret: bool = False) -> tuple[DecodePlan, tuple[jax.Array, jax.Array]]:
    """``make_plan(pallas=True, item_rows=)``'s plan and ``x_rows(x, plan.token_of_row, rows,
    block_k=)``'s rows from one launch of ``rows + 1`` programs, up to
    ``PLAN_X_ROWS_MAX_PAIRS`` pairs: program 0 the plan (``make_plan``'s kernel for ``P``: the
    pairwise one up to ``PALLAS_PLAN_MAX_PAIRS``, else the radix sort), program r + 1 row r
    (its token from the pairs' sorted rows, which each such program computes by pairwise
    comparisons)."""
    t, k = expert_ids.shape
    p = t * k
    if p > PLAN_X_ROWS_MAX_PAIRS:
        raise ValueError(f"plan_x_rows: {p} pairs, at most {PLAN_X_ROWS_MAX_PAIRS}")
    if rows < p:
        raise ValueError(f"plan_x_rows: {rows} rows for {p} pairs")
    plan = (_plan_kernel if p <= PALLAS_PLAN_MAX_PAIRS else
            functools.partial(_radix_plan_kernel, barrier=not interpret))
    kernel = functools.partial(_plan_x_rows_kernel, block_k=block_k, plan=plan)
    width = row_width(x.shape[1], block_k)
    return _plan_call(
        kernel, expert_ids, num_experts, name="moe_decode_plan_x_rows",
        num_warps=row_warps(width), interpret=interpret, item_rows=item_rows,
        inputs=(x,),
        outputs=(jax.ShapeDtypeStruct((rows, width), jnp.float16),
                 jax.ShapeDtypeStruct((rows,), jnp.float32)),
        grid=(rows + 1,))


def h_rows(gu: jax.Array, *, splits: int = 1, activation: Activation = Activation.SILU,
           layout: GateUpLayout = GateUpLayout.CONCATENATED, limit: float | None = None,
           alpha: float = GPT_OSS_ALPHA, block_k: int | None = None,
           interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The gate_up launch's output ``gu [splits * R, 2I]`` f32 (K-split partials stacked, x's
    factors and the bias applied) -> (h f16 rows ``[R, I]`` (``row_width`` wide with
    ``block_k``), their factors)."""
    if gu.ndim != 2 or gu.shape[0] % splits or gu.shape[1] % 2:
        raise ValueError(f"h_rows: expected gu [{splits} * R, 2I], got {gu.shape}")
    rows, inter = gu.shape[0] // splits, gu.shape[1] // 2
    kernel = functools.partial(
        _h_rows_kernel, rows=rows, splits=splits, layout=layout, activation=activation,
        limit=limit, alpha=alpha, block_k=block_k)
    return _launch(kernel, rows, row_width(inter, block_k), (gu,), interpret,
                   "moe_decode_h_rows")


def rows_reference(v: jax.Array, block_k: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Plain jnp: f32 rows ``v [R, K]`` -> (f16 rows scaled per row, factors), in the FP4
    operand order for ``block_k`` (``mosaic.permute_fp4_activations``, the reshape form of the
    order ``operand_source`` computes index by index)."""
    from pallas_kernels.moe_decode.mosaic import SlotTile, permute_fp4_activations

    up, down = _pow2_row_scales(jnp.max(jnp.abs(v), axis=1))
    if block_k is not None:
        v = permute_fp4_activations(v, SlotTile(block_k=block_k))
    return (v * up[:, None]).astype(jnp.float16), down
