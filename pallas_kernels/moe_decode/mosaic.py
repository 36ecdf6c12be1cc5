"""MoE decode expert matmul on the Mosaic GPU Pallas backend (Hopper, sm_90): the weight tile
as the wgmma's A operand in registers (BF16, FP8 block, NVFP4, MXFP4 weights).

Why. The Triton decode kernels (``kernel.py``) dequantize the FP8 weight tile and hand it to
``tl.dot``; Triton's layouts send the converted tile through shared memory a second time (or
read it back byte by byte) before the MMA, and that, not HBM, limits FP8 W8A16 decode to
40-60% of the HBM bandwidth on the H200. Here the e4m3 tile goes HBM -> SMEM by TMA (a
``num_stages``-deep pipeline), SMEM -> registers in the 8-bit wgmma layout (32-bit loads),
e4m3 -> f16 in registers (``cvt.rn.f16x2.e4m3x2``, one warp shuffle to the 16-bit wgmma
layout), and into ``wgmma`` as the A operand: no second trip through SMEM.

Work items. The decode plan (``kernel.make_plan``: pairs sorted by expert, one slot per
distinct expert) is cut into items of at most ``r = choose_item_rows(T)`` rows (1 at 1 token,
8 at 2-8 tokens and where the experts have few rows each, else 16; a multiple of 8 cuts at
8-aligned rows, ``kernel.cut_base``; ``work_items``): work item ``w`` owns sorted rows
``[start_w, start_w + count_w)`` of one expert ``e_w``; there are at most
``kernel.num_items(U, P, r)`` of them (a static bound; unused items have 0 rows and their
programs exit at once). The activations come in sorted-row order ``a [R, K]`` (``R =
window_rows(P, r)``: the rows past ``P`` are read by the last windows only): a program reads
the window of ``window(r)`` rows (8 for items of 1 or 8 rows, 16 for 16) from ``start_w``
rounded down to a multiple of 8 (a TMA into tiled SMEM starts at an 8-aligned
row) and its item's rows sit at offset ``start_w % 8`` in it. FP4 steps of 17-32 tokens with
few rows an expert (``blocked_items``) take the blocked plan (``kernel.blocked_plan``): each
expert's rows start a block of 8 of its own (padding rows between), so items of 8 cut no
expert of up to 8 rows in two.

Kernel (``slot_matmul``): ``out[r, n] = sum_k w[e_w, n, k] * scale(e_w, n, k) * a[r, k]`` for
every sorted row ``r`` of every item, in sorted-row order like the Triton kernels' output
(``out`` has ``a``'s R rows, so the glue between the launches needs no padding copies); other
rows of ``out`` are not written. Grid ``(W, N / 64[, k_splits])``, one warpgroup a program:
``BLOCK_N`` = 64 weight rows are the wgmma's M, the window its N.
The transposed accumulator ``[64, window]`` is stored transposed into SMEM (``WGMMA_TRANSPOSED``
layout) and the item's rows leave by TMA, one store per set bit of its row count (a TMA box
has a static shape; no other row is touched). Before the store the epilogue multiplies each
row by its ``row_factor`` (the activation rows' scale back out of f16) and adds the expert's
``bias`` row, both loaded before the K steps so their latency hides under them. With
``k_splits`` > 1 each program dots a contiguous share of the K steps into its own copy of the
output rows (split 0's with the bias), summed by the next launch (``h_rows``) or XLA.

Formats: FP8_BLOCK (e4m3 weights, f32 block scales ``[E, cdiv(N, b0), cdiv(K, b1)]``: each K
step's partial is multiplied by its block scale; 64 divides ``b0`` and ``block_k`` divides
``b1``) with f16 activations scaled per row by a power of two into f16 range (exact for bf16
inputs, as the Triton kernels' ``f16_dot`` route), and BF16 weights with bf16 activations.
These two take K steps of 128 for any K that is a multiple of 64 (gpt-oss's 2880: 23 steps):
the last step reads past K, which the TMA fills with zeros in both operands.
NVFP4 and MXFP4 (``[E, N, K/2]`` u8 codes, low nibble = even k): the code tile goes to SMEM by
TMA (one swizzled tile a row); an ``inline_mgpu`` block (``_fp4_operands_inline``) gives each
thread its own bytes of its two rows (one SMEM vector load a row), places each nibble's bits
in an e4m3 byte (``e2m1 * 2^-6``, four a 32-bit op), converts byte pairs to f16x2
(``cvt.rn.f16x2.e4m3x2``) and multiplies each by a per-row factor of its scale group: NVFP4
the e4m3 scale (exact in f16), MXFP4 ``2^(s - s_max)`` against the largest of the row's E8M0
scales the program reads (one pre-pass, the quad's threads sharing the loads; the steps
accumulate like NVFP4's, times ``2^(s_max - 127 + 6)`` at the end; each thread loads only its
own groups' scale bytes). The column order that
needs no shuffles (``fp4_operand_order``) is applied to the activations instead
(``permute_fp4_activations``). One wgmma a K step; NVFP4 accumulates in one accumulator,
times ``2^6`` and the global scale at the end. The scales come from global memory, 1-8 bytes
a row and step in loads as wide as the row stride allows (FP8: one scalar a step), issued
``SCALE_PREFETCH`` steps ahead. FP4 takes K steps of 256 where they divide K (else 192:
gpt-oss's 2880 is 15 of them), halving the per-weight share of a step's fixed cost (the
pipeline's barriers and TMA issue, the scale loads); a 192-wide step's 96-byte code rows lie
in tiles of the 32-byte swizzle. The codes keep the checkpoint's layout.
Interpret mode builds the same operands with jnp (``_fp4_operands_jnp``); the tests also run
the register-level blocks themselves on the CPU (``tests/mgpu_emulator.py``: numpy over a
warpgroup's threads) against those twins.

The full decode step (``moe_decode_mosaic_pairs``), five launches up to 1024 pairs: the plan
with its work items (``kernel.make_plan(item_rows=)``: one Pallas launch, pairwise up to 32
pairs, a radix sort up to 1024; past that XLA's plan and its item cut, ``work_items``) -> x's
f16 rows in sorted order (``rows.x_rows``) -> gate_up (x's factors and the gate_up bias in
its epilogue) -> the activation and h's f16 rows (``rows.h_rows``) -> down (h's factors and the
down bias likewise); each pair's row is picked by the caller's combine (``kernel.pairs_of``,
fused by XLA). Up to ``DOWN_MAKES_H_TOKENS`` tokens the down programs make their own h from
the gate_up output (``slot_matmul(h_source=)``) and the h launch goes. Up to 64 pairs the plan
and x's rows are one launch (``rows.plan_x_rows``): four (three with the down programs' own h).
BF16 weights take bf16 rows gathered by XLA. With f16
activations at ``FUSE_MLP_TOKENS`` tokens (from one fewer where the down programs would not
make their own h; ``fused``) gate_up, h and down are one launch
(``slot_mlp``) whose programs wait on GMEM semaphores (the comment above ``slot_mlp``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, vector
from jaxlib.mlir.dialects import math as mlir_math

from pallas_kernels._dequant import e8m0_step_to_f16, e8m0_to_f32
from pallas_kernels._device import device_sm_count
from pallas_kernels._mgpu import gep as _gep
from pallas_kernels._mgpu import i32 as _i32
from pallas_kernels._mgpu import load as _load
from pallas_kernels._mgpu import thread_rows as _thread_rows
from pallas_kernels.grouped_matmul.config import Activation, GateUpLayout, WeightFormat
from pallas_kernels.grouped_matmul.kernel import _SQRT_2_OVER_PI
from pallas_kernels.grouped_matmul.reference import (
    GPT_OSS_ALPHA,
    GPT_OSS_LIMIT,
    dequantize_weights,
    rounded,
    split_gate_up,
)
from pallas_kernels.moe_decode import rows as row_launches
from pallas_kernels.moe_decode.kernel import (
    DecodePlan,
    ExtraExperts,
    _epilogue,
    item_count,
    item_span,
    make_plan,
    num_items,
    pairs_of,
)
from pallas_kernels.moe_decode.rows import h_rows, plan_x_rows, x_rows

ROWS = 16  # the most rows of one work item
NUM_STAGES = 3  # TMA stages in flight: FP8 43 / 36 / 30 KB of SMEM a CTA at windows of 24 /
#   16 / 8 rows (H200 sweep, at 24: NOTES)
NUM_STAGES_LONG = 4  # the same for K of at least LONG_K_STEPS steps of <= 128 (H200: NOTES)
LONG_K_STEPS = 20  # gpt-oss's 23 steps of 128 take 4 stages; Qwen3's 16 (gate_up) 3
NUM_STAGES_WIDE = 2  # the same for FP4 steps of 192 / 256 (20 / 16 / 12 KB a stage at 256 and
#   windows of 24 / 16 / 8; H200, at 24: NOTES; 3 at windows of 8 / 16: Qwen3 NVFP4 8 / 32
#   tokens +7% / +10% busy, MXFP4 +2.5% / +4%, session 30)
FP4_PARTS = 2  # wgmmas an FP4 K step of 256 is dotted in (1, 2 or 4; compiled only; 4: fewer
#   registers, one more CTA an SM, yet +2.5-3% on Qwen3 NVFP4 on the H200: NOTES, session 28)
FP4_STEPS = (256, 192)  # FP4 K step widths, the first that divides K (else FP4_RAGGED_STEP's,
#   else 128 / 64). 320 (five parts of 64) takes gpt-oss's 2880 in 9 steps instead of 15 of
#   192: offline SASS (with FP4_PARTS_192=3), the K loop per code word 29.5 -> 27.2
#   instructions (MXFP4), 28.4 -> 26.6 (NVFP4), for 64 -> 72 registers (8 -> 7 CTAs an SM).
#   H200, gpt-oss MXFP4 busy us, 192 -> 320: 1 token 37.5 -> 38.3, 8 tokens 152 -> 150
#   (mixed: NOTES, session 33)
FP4_RAGGED_STEP: int | None = 256  # FP4 K steps of 256 where no FP4_STEPS width divides K (a
#   multiple of 64) and they are fewer than the narrow steps of 128 / 64, the last step ragged
#   (codes and activations zero past K, the scale loads kept on the row's groups): Gemma-4's
#   down K of 704 in 3 steps for 11 of 64, Qwen1.5-MoE's 1408 in 6 for 11 of 128. H100 SXM
#   same-run busy us, off -> on (session 37): Gemma-4 NVFP4 1 / 8 / 32 tokens -0.4 / -4.3 /
#   -3.4%, MXFP4 -1.9 / -5.0 / -4.6%; Qwen1.5-MoE NVFP4 -12.8 / -3.0 / -2.4%, MXFP4 -13.9 /
#   -1.6 / -0.8%. Where a width of FP4_STEPS divides K it stays (gpt-oss's 2880 in 15 of 192
#   against 12 of 256 ragged, FP4_STEPS=(256,): H100 MXFP4 1 / 8 tokens +2.5 / -1.1%, NVFP4
#   -0.7 / -3.2%, session 36, mixed; offline ptxas 91-95 -> 72-74 registers, session 34).
#   None: FP4_STEPS, else 128 / 64.
FP4_PARTS_192 = 1  # the same for steps of 192 (gpt-oss's K of 2880; 1 or 3). 3 (parts of 64):
#   offline ptxas at windows of 8 (16), with H_KEEP_CHUNKS=8, gpt-oss MXFP4 gate_up
#   93 -> 64 registers (100 -> 72), the one launch 95 -> 68 (103 -> 72): 5 -> 7 CTAs an SM, for
#   +7% K-loop instructions (two more wgmma waits a step). H200, gpt-oss MXFP4 busy us, 1 -> 3:
#   1 token 39.2 -> 39.8, 8 tokens 150 -> 151 (NOTES, session 33)
EPILOGUE_LOADS_AHEAD = True  # the epilogue's row factors and bias loaded before the K steps
#   (False: after them: ptxas 83 -> 79 registers for Qwen3 MXFP4 at windows of 8, 83 -> 78 FP8 at
#   16, a CTA more an SM each; H200: Qwen3 MXFP4 8 tokens -2.9% busy, gpt-oss MXFP4 1 token
#   +0.7 us, the other cases even: NOTES, session 29)
SCALE_PREFETCH = 3  # K steps a scale load is issued before its step (1: the step before)
# MXFP4's factors are against each row's largest scale over the program's K (one pre-pass; the
#   steps accumulate like NVFP4's). Against each K step's largest (a partial a step, removed in
#   session 34) the K loop had 433 / 379 instructions (Qwen3 / gpt-oss gate_up, offline SASS at
#   windows of 8; now 387 / 332) and 80 / 103 / 82 registers (Qwen3 / gpt-oss / DeepSeek-V3;
#   now 75 / 93 / 75). H200 busy us, per step -> row max (session 33): Qwen3 8 / 32 tokens 61.9
#   -> 58.1 / 127 -> 124, gpt-oss 1 / 8 tokens 42.9 -> 39.2 / 163 -> 152, DeepSeek-V3 8 tokens
#   369 -> 343 (0.706 -> 0.738 of HBM)
BLOCK_N = 64  # weight rows a program (the wgmma's M)
# Items at T tokens (``choose_item_rows``): 1 row at 1 token (windows of 8), aligned items of 8
# rows at 2-8 tokens and where the routed rows an expert are few (windows of 8; BF16 16), else
# of 16 (windows of 16). H200, windows of 24 -> 16: Qwen3 FP8 / NVFP4 / MXFP4 8 tokens 87.0 ->
# 84.5 / 70.9 -> 64.5 / 76.5 -> 67.9 us (NOTES, session 25); 16 -> 8: NOTES, session 27.
# MIN_ITEM_ROWS: the fewest rows an item is cut to (a wider window at 1 token).
# SMALL_ITEM_TOKENS: items of 8 up to this many tokens. SMALL_ITEM_DENSITY: and past it where
# the pairs over the experts (``T * k / E``: rows an expert on average) are at most this. H200,
# Qwen3-30B-A3B busy us, items of 16 -> 8 (session 31): 16 tokens (density 1) NVFP4 91 -> 84,
# MXFP4 98 -> 94, FP8 119 -> 112; 24 (1.5) 110 -> 106 / 118 -> 118 / 143 -> 140; 32 (2) 120 ->
# 123 / 128 -> 137 / 157 -> 156; 64 (4) 134 -> 150 / 141 -> 163 / 177 -> 183 (an expert whose
# rows cross an 8-row cut is read and converted twice); gpt-oss MXFP4 16 tokens (2) 288 -> 284.
# BLOCKED_ITEM_TOKENS: the (first, last) token counts whose plan moves each expert's rows to
# blocks of 8 of their own (``kernel.blocked_plan``): items of 8 with no expert's rows crossing
# a cut unless it has more than 8. H200, the Mosaic launch at 32 tokens with XLA's blocked plan,
# items of 16 -> blocks: NVFP4 103 -> 96.4 us, MXFP4 114 -> 105; 64 tokens (three launches)
# 109 -> 108 / 117 -> 112 (session 31). With the radix program's blocked plan, the full step
# (session 36, H100 SXM: no H200 was lent; one round each, busy us): Qwen3 NVFP4 24 / 32 tokens
# 124 -> 121 / 137 -> 133 and 134 (two calls), MXFP4 123 -> 120 / 139 -> 131 and 130; 16
# tokens (items of 8 already) 99.6 -> 101 / 98.8 -> 98.4. Only where timed: FP4
# (``BLOCKED_FORMATS``; FP8 not timed) at up to ``BLOCKED_MAX_DENSITY`` rows an expert (Qwen3
# at 32 tokens: 2; Mixtral's 8 would read its experts' weights in more items than 16-row ones).
MIN_ITEM_ROWS = 1
SMALL_ITEM_TOKENS = 8
SMALL_ITEM_DENSITY = 1.5
BLOCKED_ITEM_TOKENS: tuple[int, int] | None = (17, 32)
BLOCKED_MAX_DENSITY = 2.0
BLOCKED_FORMATS = ("nvfp4", "mxfp4")


def blocked_items(tokens: int, fmt: str | None, density: float) -> bool:
    """Whether a step of ``tokens`` whose experts have ``density`` rows each on average (the
    pairs over the experts, ``T * k / E``) takes the blocked plan: ``fmt`` in
    ``BLOCKED_FORMATS``, ``tokens`` in ``BLOCKED_ITEM_TOKENS``, ``density`` at most
    ``BLOCKED_MAX_DENSITY``."""
    span = BLOCKED_ITEM_TOKENS
    return (fmt in BLOCKED_FORMATS and span is not None and span[0] <= tokens <= span[1]
            and density <= BLOCKED_MAX_DENSITY)


def window(rows: int) -> int:
    """Activation rows a program reads (the wgmma's N) for items of at most ``rows`` rows, from
    the item's first row rounded down to a multiple of 8 (a TMA into tiled SMEM starts at an
    8-aligned row) past its last: ``rows`` for a multiple of 8 (aligned items,
    ``kernel.cut_base``), else 8 for 1 row, 16 for 2-7 and 9, 24 for 10-15."""
    return rows if rows % 8 == 0 else 8 * -(-(7 + rows) // 8)


def choose_item_rows(tokens: int, fmt: str | None = None, density: float | None = None) -> int:
    """Pure heuristic: the rows work items are cut to at ``tokens`` tokens: 1 at 1 token (at
    least ``MIN_ITEM_ROWS``), aligned items (``kernel.cut_base``) of 8 rows at 2 to
    ``SMALL_ITEM_TOKENS`` (8) tokens, blocks of 8 where ``blocked_items`` (given
    ``density``), and past those where ``density`` (the pairs over the experts, ``T *
    k / E``) is at most ``SMALL_ITEM_DENSITY``; otherwise (and for BF16 ``fmt``) of 16. An
    expert's rows (at most T under top-k routing) are one item unless they cross a cut: with
    aligned 8-row items that is ~1 of 54 experts at 8 tokens (Qwen3-30B-A3B; its weights read
    twice) for windows of 8 rows in place of 16, which pays where activations are a large
    share of a program's bytes (FP8, FP4: NOTES, session 27) and the experts have few rows
    each (session 31); blocks cross no cut; 16-row items cut only slots of 10 rows or more."""
    if tokens <= 1:
        return max(MIN_ITEM_ROWS, 1)
    small = (tokens <= SMALL_ITEM_TOKENS
             or (density is not None and (blocked_items(tokens, fmt, density)
                                          or density <= SMALL_ITEM_DENSITY)))
    return 8 if small and fmt != "bf16" else ROWS


@dataclasses.dataclass(frozen=True)
class SlotTile:
    """Tile of one program (one warpgroup, ``BLOCK_N`` weight rows): ``block_k`` of K per
    pipeline step, ``num_stages`` TMA stages in flight, work items of at most ``rows`` rows
    (the caller's contract), read in activation windows of ``window(rows)`` rows."""

    block_k: int = 128
    num_stages: int = NUM_STAGES
    rows: int = ROWS

    @property
    def window(self) -> int:
        return window(self.rows)

    def __post_init__(self):
        if not isinstance(self.rows, int) or not 1 <= self.rows <= ROWS:
            raise ValueError(f"SlotTile.rows: expected an int in [1, {ROWS}], got {self.rows!r}")
        if self.block_k not in (64, 128, 192, 256, 320):
            raise ValueError(
                f"SlotTile.block_k: expected 64, 128, 192, 256 or 320, got {self.block_k!r}")
        if not isinstance(self.num_stages, int) or not 2 <= self.num_stages <= 8:
            raise ValueError(
                f"SlotTile.num_stages: expected an int in [2, 8], got {self.num_stages!r}")


def choose_slot_tile(k: int, num_stages: int | None = None, fmt: str | None = None,
                     rows: int = ROWS) -> SlotTile:
    """Pure heuristic: K steps of 128 where they divide K, else 64; FP8 and BF16 (``fmt``)
    take steps of 128 for any K that is a multiple of 64 (the last step ragged), NVFP4 and
    MXFP4 the first of ``FP4_STEPS`` that divides K (256, else 192: gpt-oss's 2880 in 15
    steps). Stages: ``NUM_STAGES``, ``NUM_STAGES_LONG`` where K is ``LONG_K_STEPS`` steps or
    more (gpt-oss's 2880: 23 of 128), ``NUM_STAGES_WIDE`` for steps wider than 128, unless
    given. ``rows``: the items' rows (``choose_item_rows``). FP4 that no width of
    ``FP4_STEPS`` divides takes ``FP4_RAGGED_STEP``'s steps (the last ragged) where they are
    fewer than the narrow ones."""
    wide = [w for w in FP4_STEPS if k % w == 0] if fmt in _WIDE_FORMATS else []
    narrow = 128 if k % 128 == 0 or _takes_ragged_k(fmt, k) else 64
    if (not wide and _fp4_ragged(fmt, k, FP4_RAGGED_STEP)
            and -(-k // FP4_RAGGED_STEP) < k // narrow):
        wide = [FP4_RAGGED_STEP]
    block_k = wide[0] if wide else narrow
    if num_stages is None and block_k > 128:
        num_stages = NUM_STAGES_WIDE
    elif num_stages is None:
        num_stages = NUM_STAGES_LONG if -(-k // block_k) >= LONG_K_STEPS else NUM_STAGES
    return SlotTile(block_k=block_k, num_stages=num_stages, rows=rows)


def _item_rows(tiles, name: str) -> int:
    """The items' rows of a (gate_up, down) tile pair: one cut of the items serves both."""
    if tiles[0].rows != tiles[1].rows:
        raise ValueError(f"{name}: expected the same rows in both (the items'), got "
                         f"{tiles[0].rows} and {tiles[1].rows}")
    return tiles[0].rows


def num_k_steps(k: int, tile: SlotTile) -> int:
    """K steps of ``tile`` over K (the last one ragged where ``block_k`` does not divide K)."""
    return -(-k // tile.block_k)


# Programs an SM choose_k_splits sizes the K splits for (timed with windows of 24 rows, when 4-5
# CTAs fit an SM; the smaller windows of 1-9 tokens fit more: not re-timed yet).
K_SPLIT_PROGRAMS_PER_SM = 4


def choose_k_splits(items: int, n: int, k: int, tile: SlotTile, *, sms: int = 132,
                    per_sm: int | None = None) -> int:
    """Pure heuristic: the largest split of K (a divisor of its steps, at least 2 steps a
    program) whose ``items * n / BLOCK_N * split`` programs stay within 1.25 x ``per_sm``
    (default ``K_SPLIT_PROGRAMS_PER_SM``) programs an SM (``items``: the work items expected,
    e.g. ``min(experts, tokens * top_k)``); ``moe_decode_mosaic_pairs``' default
    (``k_splits="auto"``)."""
    per_sm = K_SPLIT_PROGRAMS_PER_SM if per_sm is None else per_sm
    steps = num_k_steps(k, tile)
    programs = max(items, 1) * (n // BLOCK_N)
    best = 1
    for d in range(2, steps // 2 + 1):
        if steps % d == 0 and programs * d <= 1.25 * per_sm * sms:
            best = d
    return best


def window_rows(num_rows: int, rows: int = ROWS) -> int:
    """Rows the activations need so that every window of items of at most ``rows`` rows lies
    inside them: the last window starts at most at ``num_rows`` rounded up to 8, minus 8."""
    return -(-num_rows // 8) * 8 + window(rows) - 8


def _transforms(row_bytes: int, itemsize: int):
    swizzle = plgpu.find_swizzle(row_bytes * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _stack_size(fmt: str) -> int:
    """Arrays per weight stack: w, then scale (FP8, NVFP4, MXFP4), then global scale (NVFP4)."""
    return {"bf16": 1, "fp8": 2, "mxfp4": 2, "nvfp4": 3}[fmt]


def _kernel(
    work_gmem,  # [3, W] int32: expert id (>= E + E2: unused item), first sorted row, row count
    a_gmem,  # [R, K] f16 | bf16: activations in sorted-row order (R >= window_rows(P)); FP4:
    #   permute_fp4_activations(., tile)
    *rest,  # per stack (main, [extra]): w [E, N, K] e4m3 | bf16, or [E, N, K/2] u8
    #   (FP4); FP8: scale [E, cdiv(N, b0), cdiv(K, b1)] f32; NVFP4: scale [E, N, K/16] e4m3,
    #   global [E, R] f32; MXFP4: scale [E, N, K/32] u8. Then [row_factor [R] f32], [bias
    #   [E, N] (the main stack's)], out [R, N] f32, [w_stage (interpret mode): [BLOCK_N, bk]
    #   16-bit]
    num_stacks: int,
    row_factor: bool,
    bias: bool,
    **static,  # _matmul_program's
):
    stacks, rest = _split_stacks(rest, static["fmt"], num_stacks)
    factor_ref = rest.pop(0) if row_factor else None
    bias_ref = rest.pop(0) if bias else None
    o_gmem, *w_stage = rest
    split = lax.axis_index("s") if static["k_splits"] > 1 else None
    _matmul_program(work_gmem, a_gmem, stacks, factor_ref, bias_ref, o_gmem,
                    w_stage[0] if w_stage else None, u=lax.axis_index("w"),
                    nt=lax.axis_index("n"), split=split, **static)


# Three launches (f16 activations, K of down a multiple of its step, or FP4_RAGGED_STEP's ragged
# steps, h zero past I): each down program makes
# its window's h for its own K steps from the gate_up output in L2 (``slot_matmul(h_source=)``:
# ``_h_program_inline`` a row of its item at a time into an SMEM tile in the wgmma B layout),
# and the h launch (``rows.h_rows``) goes: one launch and its gap fewer a step at 1-7 tokens,
# for ~100 L2 gathers a thread before each down program's first wgmma. H200 busy us, h launch
# -> own h (session 33): Qwen3 NVFP4 1 / 3 tokens 20.8 -> 19.6 / 35.1 -> 34.5, FP8 1 token 23.0
# -> 22.2; gpt-oss MXFP4 1 token 39.3 -> 37.5. Each of an item's N / 64 down programs remakes
# the item's h, so the L2 reads grow with its rows (Qwen3 at 64 tokens: ~4 rows, ~100 MB a
# step against the h launch's ~3 MB); up to this many tokens (the range below session 24's one
# launch, where it was timed; the one launch now starts at 4, so 4-7 only with fused=False;
# 0: never).
DOWN_MAKES_H_TOKENS = 7
# ... where its h tile (f16 ``[window, K / k_splits]`` in SMEM, beside the pipeline's stages) is
# at most this many bytes, else the h launch. The timed tiles (session 33): Qwen3 6-12 KB,
# gpt-oss MXFP4 at 1 token 15 KB (K over 3 programs). Larger ones cost CTAs an SM (SMEM), and
# Mixtral's I of 14336 at 3-7 tokens (one program over K) needs 224 KB: with the stages past
# the H200's 227 KB a CTA, so that kernel did not compile (offline ``mosaic_registers.py --case
# all``, session 35). Tiles of 16-45 KB (DeepSeek-V3 / V4, LongCat, MiniMax-M2, Qwen1.5-MoE,
# gpt-oss FP4 at 2-7 tokens) take the h launch, as before session 33; where timed they lose:
# the bound at 64 KB (session 36, H100, busy us), DeepSeek-V3 MXFP4 at 1 / 4 tokens (32 KB)
# 106 -> 108 / 286 -> 316.
H_TILE_MAX_BYTES = 16 * 1024
# ... its h chunks kept in registers up to this many a thread (else recomputed, rolled): the
# down kernel's registers are the largest of its h part's and its K loop's. Offline ptxas,
# gpt-oss MXFP4 down at windows of 8, one K split (12 chunks a thread): kept 176 registers,
# rolled 103 (as with the h launch); Qwen3's 3 chunks kept: 71-79, as without.
H_TILE_KEEP_CHUNKS = 4

def _split_stacks(refs, fmt: str, num_stacks: int):
    """``refs``' first ``num_stacks`` weight stacks, each ``_stack_size(fmt)`` refs (w,
    [scale], [global]), and the refs after them: ``(stacks, rest)``."""
    size = _stack_size(fmt)
    stacks = [refs[i * size:(i + 1) * size] for i in range(num_stacks)]
    return stacks, list(refs[num_stacks * size:])


def _matmul_program(
    work_gmem,  # [3, W] int32 (``_kernel``)
    a_gmem,  # [R, K] activations (``_kernel``)
    stacks,  # per stack (main, [extra]): (w, [scale], [global]) (``_kernel``)
    factor_ref,  # [R] f32 or None
    bias_ref,  # [E, N] or None (the main stack's)
    o_gmem,  # [k_splits * R, N] f32
    w_stage,  # interpret mode: [BLOCK_N, bk] SMEM (the interpreter's wgmma reads A from
    #   SMEM); compiled: None
    *,
    u,  # the work item
    nt,  # the tile of BLOCK_N output columns
    split,  # the K split (None: k_splits == 1)
    tile: SlotTile,
    fmt: str,  # "bf16" | "fp8" | "nvfp4" | "mxfp4"
    fp8_block: tuple[int, int] | None,
    global_rows: int,  # NVFP4: rows sharing one global scale
    k: int,  # the contraction length (unpacked)
    k_splits: int,  # programs along K: split s dots steps [s * num_steps, (s + 1) * num_steps)
    h_from: dict | None = None,  # the down programs' own h: a_gmem is the gate_up output
    #   [S * R, 2I] f32 and the program makes its window's h for its K steps
    #   (``_h_program_inline``'s keywords: splits, rows, layout, activation, limit, alpha,
    #   block_k)
):
    """One program of ``slot_matmul``: item ``u``'s rows through its expert's weight rows
    ``[nt * BLOCK_N, (nt + 1) * BLOCK_N)``, K split ``split``, stored to ``o_gmem``."""
    stage_w = w_stage is not None
    w_dtype = stacks[0][0].dtype
    bn, bk, wn = BLOCK_N, tile.block_k, tile.window
    num_steps = num_k_steps(k, tile) // k_splits  # K steps of this program

    def at(kb):
        """This program's K step ``kb`` -> the step of the whole K."""
        return kb if split is None else split * num_steps + kb

    e = work_gmem[0, u]
    start = work_gmem[1, u]
    num_rows = work_gmem[2, u]  # 0 for an unused item
    # out [k_splits * R, N]: split s at rows s * R
    rows_total = h_from["rows"] if h_from else a_gmem.shape[0]
    out_row = start if split is None else split * rows_total + start
    row0 = pl.multiple_of(start - lax.rem(start, 8), 8)  # the window's first row
    n0 = pl.multiple_of(nt * bn, bn)
    a_dtype = jnp.dtype(jnp.float16) if h_from else a_gmem.dtype  # the activations'

    def staged(w):
        """``w`` as the wgmma's A operand: in registers, or (interpreter, whose wgmma reads A
        from SMEM only) through SMEM."""
        if not stage_w:
            return w
        w_stage[...] = w
        plgpu.commit_smem()
        return w_stage

    def operand(w_smem):
        """The weight tile as the wgmma's A operand: [bn, bk] in registers (e4m3 -> f16)."""
        w = w_smem[...]
        return staged(w if w.dtype == a_dtype else w.astype(a_dtype))

    fp4 = fmt in ("nvfp4", "mxfp4")
    # codes: a swizzled tile a row (a thread's SMEM vector loads); activations: the widest
    # swizzle (K-major wgmma B operand)
    # K step kb of this program is step at(kb) of the whole K: the tiles are not sliced along
    # K (a ragged last step reads past K, which the TMA fills with zeros)
    # the TMA tiles the weights' GMEM by the swizzle's columns, which must divide K: a ragged
    # FP8 K (a multiple of 64) takes the 64-byte swizzle
    w_row_bytes = (64 if k % bk else bk) * w_dtype.itemsize
    w_spec = plgpu.BlockSpec((bn, bk // 2 if fp4 else bk), lambda kb: (0, at(kb)),
                             transforms=_code_transforms(bk, k) if fp4 else _transforms(
                                 w_row_bytes, w_dtype.itemsize))
    # 16-bit weights: the wgmma of step kb still reads its activation tile while step kb + 1
    # runs (delay_release), each step waits only for the one before.
    a_spec = plgpu.BlockSpec((wn, bk), lambda kb: (0, at(kb)),
                             transforms=_transforms(bk * a_dtype.itemsize, a_dtype.itemsize),
                             delay_release=1 if fmt == "bf16" else 0)

    prefetch = min(SCALE_PREFETCH, num_steps)

    def ahead(load):
        """The scales ``prefetch`` steps ahead: ``(first, advance)``, ``first`` the loads of
        steps ``0 .. prefetch - 1`` and ``advance(kb, queue) -> (step kb's load, the queue of
        kb + 1 .. kb + prefetch)``, issuing step ``kb + prefetch``'s load (clamped to the
        last step)."""
        first = tuple(load(min(i, num_steps - 1)) for i in range(prefetch))

        def advance(kb, queue):
            return queue[0], queue[1:] + (load(jnp.minimum(kb + prefetch, num_steps - 1)),)

        return first, advance

    def pipeline(step, init_carry, w_tile, a_tile):
        """``emit_pipeline`` over the K steps: weights and activations (``a_tile``: the
        window's rows in GMEM) by TMA, or (``h_from``: ``a_tile`` the program's own h tile
        ``[num_steps, wn, bk]`` in SMEM) the weights only, each step's activations
        ``a_tile.at[step]``."""
        if h_from is None:
            return plgpu.emit_pipeline(
                step, grid=(num_steps,), in_specs=[w_spec, a_spec],
                max_concurrent_steps=tile.num_stages, init_carry=init_carry)(w_tile, a_tile)
        return plgpu.emit_pipeline(
            lambda idx, w_smem, carry: step(idx, w_smem, a_tile.at[idx[0]], carry),
            grid=(num_steps,), in_specs=[w_spec], max_concurrent_steps=tile.num_stages,
            init_carry=init_carry)(w_tile)

    def scaled_steps(w_tile, a_tile, scale_ref, e):
        """FP8: each step's partial (its own accumulator) times the step's block scale, loaded
        ``SCALE_PREFETCH`` steps before (a global load per step on the critical path had held
        the kernel near 55% of HBM on the H200)."""
        b0, b1 = fp8_block
        row_block = lax.div(n0, b0)
        first, advance = ahead(lambda kb: scale_ref[e, row_block, lax.div(at(kb) * bk, b1)])

        def step(idx, w_smem, a_smem, carry):
            (kb,) = idx
            acc, queue = carry
            s, queue = advance(kb, queue)
            w = operand(w_smem)

            def one_step(part):
                plgpu.wgmma(part, w, a_smem.transpose((1, 0)))  # [bn, bk] x [bk, wn]
                return part[...]

            part = pl.run_scoped(one_step, plgpu.ACC((bn, wn), jnp.float32))
            return acc + part * s, queue

        zeros = plgpu.layout_cast(jnp.zeros((bn, wn), jnp.float32), plgpu.Layout.WGMMA)
        acc, _ = pipeline(step, (zeros, first), w_tile, a_tile)
        return acc

    def fp4_steps(w_tile, a_tile, scale_ref, global_ref, e):
        """NVFP4 / MXFP4: each step's codes become one ``[bn, bk]`` f16 A operand with the
        scales folded in (``_fp4_operands_inline``), every step into one accumulator; MXFP4's
        factors are against the rows' largest scales over the program's steps (a pre-pass
        before them), the accumulator then times ``2^(s_max - 127 + PLACEMENT)``. The scale
        bytes are loaded ``SCALE_PREFETCH`` steps before their step turns them into factors (a
        load's latency not on a step's path)."""
        ragged = k % bk != 0  # FP4_RAGGED_STEP: the last step's scale loads kept on the row
        if stage_w:
            bits_of = functools.partial(_fp4_scale_bits_jnp, scale_ref, e, n0, fmt=fmt,
                                        tile=tile)
            factors_of = functools.partial(_fp4_factors_jnp, fmt=fmt)
            operands_of = _fp4_operands_jnp
        else:
            bits_of = functools.partial(_fp4_scale_bits_inline, scale_ref,
                                        e * scale_ref.shape[1] + n0, fmt=fmt, tile=tile,
                                        ragged=ragged)
            factors_of = functools.partial(_fp4_factors_inline, fmt=fmt, tile=tile)
            operands_of = functools.partial(_fp4_operands_inline, tile=tile, k=k)
        first, advance = ahead(lambda kb: bits_of(at(kb)))
        if fmt == "mxfp4":  # each row's largest scale over this program's K steps (after the first
            #   steps' scale loads are issued: their latency overlaps the pre-pass's)
            step_groups = bk // 32
            span = dict(groups=num_steps * step_groups)
            first_group = at(0) * step_groups
            if stage_w:
                top = _mx_row_top_jnp(scale_ref, e, n0, first_group, **span)
            else:
                top = _mx_row_top_inline(scale_ref, e * scale_ref.shape[1] + n0, first_group,
                                         step_groups=step_groups, ragged=ragged, **span)
            factors_of = functools.partial(factors_of, top=top)

        # compiled steps of 256 as FP4_PARTS wgmmas in turn (192: FP4_PARTS_192), the operand's
        # registers reused: two of 128: ptxas 121 -> 80 registers (Qwen3 NVFP4), 132 -> 105
        # (MXFP4); H200, MXFP4 8 / 64 tokens -4.5% / -3%, NVFP4 even (NOTES, session 24)
        parts = 1 if stage_w else {256: FP4_PARTS, 192: FP4_PARTS_192, 320: 5}.get(bk, 1)

        def step(idx, w_smem, a_smem, carry):
            """Step ``idx``'s wgmma into the accumulator, waited: one of ``[bn, bk]``, or
            ``parts`` of ``[bn, bk / parts]`` in turn, each part's operand converted after the
            previous wgmma (their registers reused)."""
            acc_ref, queue = carry
            bits, queue = advance(idx[0], queue)
            factors = factors_of(bits)
            if parts == 1:
                w = staged(operands_of(w_smem, factors))
                plgpu.wgmma(acc_ref, w, a_smem.transpose((1, 0)))  # [bn, bk] x [bk, wn]
                plgpu.wgmma_wait(0)  # w's registers and the activation tile are free again
                return acc_ref, queue
            cols = bk // parts
            for h in range(parts):
                w = operands_of(w_smem, factors, part=h, parts=parts)
                a_part = a_smem.at[:, pl.ds(h * cols, cols)]
                plgpu.wgmma(acc_ref, w, a_part.transpose((1, 0)))
                plgpu.wgmma_wait(0)
            return acc_ref, queue

        if fmt == "nvfp4":  # the global scale loaded before the steps (read after them)
            outer = global_ref[e, lax.div(n0, global_rows)] * 2.0**_PLACEMENT

        def run(acc_ref):
            pipeline(step, (acc_ref, first), w_tile, a_tile)
            return acc_ref[...]

        acc = pl.run_scoped(run, plgpu.ACC((bn, wn), jnp.float32))
        if fmt == "mxfp4":  # the rows' 2^(top - 127 + PLACEMENT)
            factor = (_mx_row_factor_jnp if stage_w else _mx_row_factor_inline)(top)
            outer = lax.broadcast_in_dim(factor, (bn, wn), [0])
        return acc * outer  # the operands held e2m1 * s * 2^-PLACEMENT

    def plain_steps(w_tile, a_tile):
        """16-bit weights: one accumulator, wgmma kept in flight across steps."""

        def step(idx, w_smem, a_smem, acc_ref):
            plgpu.wgmma(acc_ref, operand(w_smem), a_smem.transpose((1, 0)))
            plgpu.wgmma_wait(1)
            return acc_ref

        def run(acc_ref):
            pipeline(step, acc_ref, w_tile, a_tile)
            return acc_ref[...]

        return pl.run_scoped(run, plgpu.ACC((bn, wn), jnp.float32))

    def store_rows(o_smem, offset):
        """The item's rows ``[offset, offset + num_rows)`` of ``o_smem`` to ``out`` rows
        ``[out_row, out_row + num_rows)``: one TMA store per set bit of ``num_rows`` (<=
        tile.rows)."""
        done = jnp.int32(0)
        size = 1 << (tile.rows.bit_length() - 1)
        while size >= 1:
            @pl.when(num_rows & size != 0)
            def _(size=size, done=done):
                plgpu.copy_smem_to_gmem(
                    o_smem.at[pl.ds(offset + done, size)],
                    o_gmem.at[pl.ds(out_row + done, size), pl.ds(n0, bn)])

            done = done + (num_rows & size)
            size //= 2

    def make_h(h_tile, h_factor, red):
        """The down programs' own h: the window's h for this program's K steps into
        ``h_tile`` (the item's rows; interpret mode every window row) and their factors into
        ``h_factor``."""
        k0, kcols = at(0) * bk, num_steps * bk
        if stage_w:
            values, factors = _h_tile_jnp(a_gmem, row0, k0, wn=wn, kcols=kcols, bk=bk,
                                          **h_from)
            h_tile[...] = values
            h_factor[...] = factors
            return

        def one_row(i, carry):
            _h_program_inline(a_gmem, h_tile, h_factor, start + i, 1, red, **h_from,
                              tile=(start - row0 + i, k0, kcols, wn, bk))
            return carry

        lax.fori_loop(0, num_rows, one_row, None)
        plgpu.commit_smem()  # the generic stores before the wgmmas read the tile

    def run(w_gmem, *scales, e, bias_ref=None):
        """This item's rows through expert ``e`` of one stack, stored; with ``h_from``, the
        program's h tile made first, in a scope around the whole program."""
        if h_from is None:
            run_on(w_gmem, *scales, e=e, bias_ref=bias_ref, a_tile=a_gmem.at[pl.ds(row0, wn)],
                   window_factor=factor_ref, first_factor=row0)
            return

        def scoped(h_tile, h_factor, red):
            make_h(h_tile, h_factor, red)
            run_on(w_gmem, *scales, e=e, bias_ref=bias_ref, a_tile=h_tile,
                   window_factor=h_factor, first_factor=0)

        pl.run_scoped(scoped, plgpu.SMEM((num_steps, wn, bk), jnp.float16,
                                         transforms=_transforms(bk * 2, 2)),
                      plgpu.SMEM((wn,), jnp.float32), plgpu.SMEM((4,), jnp.float32))

    def run_on(w_gmem, *scales, e, bias_ref, a_tile, window_factor, first_factor):
        """``run`` with its activations ``a_tile`` (``pipeline``'s) and the window rows'
        factors from ``window_factor[first_factor:]`` (or None)."""
        w_tile = w_gmem.at[e, pl.ds(n0, bn)]

        def epilogue_operands():
            """The window rows' factors ``[bn, wn]`` and the bias ``[bn]`` (or None)."""
            if stage_w:
                factors = None if window_factor is None else lax.broadcast_in_dim(
                    window_factor[pl.ds(first_factor, wn)], (bn, wn), [1])
                b = None if bias_ref is None else bias_ref[e, pl.ds(n0, bn)].astype(
                    jnp.float32)
                return factors, b
            factors = None if window_factor is None else _window_factors_inline(
                window_factor, first_factor, wn)
            b = None if bias_ref is None else _row_bias_inline(
                bias_ref, e * bias_ref.shape[1] + n0)
            return factors, b

        if EPILOGUE_LOADS_AHEAD:  # before the steps: their latency hidden, registers held
            factors, b = epilogue_operands()
        match fmt:  # acc [bn, wn]
            case "bf16":
                acc = plain_steps(w_tile, a_tile)
            case "fp8":
                acc = scaled_steps(w_tile, a_tile, scales[0], e)
            case _:
                acc = fp4_steps(w_tile, a_tile, scales[0],
                                scales[1] if fmt == "nvfp4" else None, e)
        if not EPILOGUE_LOADS_AHEAD:
            factors, b = epilogue_operands()
        if factors is not None:  # the window rows' factors: each column its own
            acc = acc * factors
        if b is not None:  # the bias once: in split 0
            on = jnp.float32(1.0) if split is None else jnp.where(split == 0, 1.0, 0.0)
            acc = acc + lax.broadcast_in_dim(b * on, (bn, wn), [0])

        def store(o_smem):  # o_smem[r, n] = acc[n, r]: the accumulator stored transposed
            o_smem.transpose((1, 0))[...] = plgpu.layout_cast(acc,
                                                              plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.commit_smem()
            store_rows(o_smem, start - row0)
            plgpu.wait_smem_to_gmem(0)

        # scoped after the pipeline's scope has closed: the store's SMEM reuses its buffers
        pl.run_scoped(store, plgpu.SMEM((wn, bn), jnp.float32))

    main_experts = stacks[0][0].shape[0]

    @pl.when((num_rows > 0) & (e < main_experts))
    def _():
        run(*stacks[0], e=e, bias_ref=bias_ref)

    if len(stacks) == 2:  # expert ids from main_experts on name the extra stack's experts
        @pl.when((num_rows > 0) & (e >= main_experts))
        def _():
            run(*stacks[1], e=e - main_experts)


# ---------------------------------------------------------------------------------------------
# NVFP4 / MXFP4 operands: the codes of a K step -> f16 wgmma A operands with the scales in.
# ---------------------------------------------------------------------------------------------
#
# A thread of the warpgroup holds, in the wgmma's register A layout ([64, 16] f16, WGMMA), rows
# r and r + 8 (r = 16 * warp + lane // 4) and columns 2c, 2c + 1, 8 + 2c, 9 + 2c (c = lane % 4)
# of each operand. Here thread c of a quad reads bytes [c * bk / 8, (c + 1) * bk / 8) of its
# rows' codes (one 16- or 8-byte SMEM load a row), 32-bit words of 8 nibbles n0..n7, each word
# four f16x2 registers: the low nibbles become four e4m3 bytes by bit placement (sign to bit 7,
# magnitude to bits 4-2: ``e2m1 * 2^-PLACEMENT``, four a 32-bit op), the high ones likewise,
# and ``cvt.rn.f16x2.e4m3x2`` turns each half into a register: (n0, n2), (n4, n6), (n1, n3),
# (n5, n7).
# Which K column lands in which operand column follows from that (``fp4_operand_order``); the
# activations are permuted to match (``permute_fp4_activations``), so no shuffle is needed.
# Every 32-bit word of a thread lies in one scale group, so a thread multiplies each register
# by one of at most two per-row factors: NVFP4 the e4m3 scale ``s`` (the product, ``e2m1 * s *
# 2^-PLACEMENT``, is exact in f16: a multiple of 2^-16 with at most 6 significant bits), MXFP4
# ``2^(s - s_max)`` against the largest of the row's scales over the program's K steps
# (``e8m0_step_to_f16``; exact for ``s - s_max >= PLACEMENT - 23``, where the product's lowest
# bit stays >= 2^-24; one accumulator, ``2^(s_max - 127 + PLACEMENT)`` once at the end).

def _code_transforms(block_k: int, k: int | None = None):
    """Code tiles ``[bn, bk / 2]`` u8 in SMEM: one swizzled tile a row (128, 64 or 32 bytes),
    so a quarter warp's 16-byte (8-byte) row loads meet no bank twice; over a ragged K
    (``_fp4_ragged``) tiles of a swizzle that also divides the K / 2 bytes of a code row (the
    TMA tiles the GMEM rows by it: 32 for gpt-oss's 1440)."""
    return _transforms(int(np.gcd(block_k // 2, (k or block_k) // 2)), 1)


_PLACEMENT = 6  # the converted codes are e2m1 * 2^-PLACEMENT (e4m3 bytes)


def _to_operand_order(x):
    """``x [..., bk]`` in K order (one step) -> the FP4 operands' column order: thread c's word
    w, register 2hh + j, lane q (K column ``c bk/4 + 8w + nibble``, nibble ``4j + 2q + hh``;
    see above) goes to position ``16 (2w + hh) + 8j + 2c + q`` (operand 2w + hh, column 8j +
    2c + q)."""
    *lead, bk = x.shape
    x = x.reshape(*lead, 4, bk // 32, 2, 2, 2)  # (c, w, then the nibble's bits j, q, hh)
    n = len(lead)
    c, w, j, q, hh = range(n, n + 5)
    return x.transpose(*range(n), w, hh, j, c, q).reshape(*lead, bk)


def fp4_operand_order(block_k: int) -> np.ndarray:
    """``[block_k]``: the K column (within a step) of each activation column the FP4 kernels
    read, operand after operand (operand h: columns 16h .. 16h + 15)."""
    return _to_operand_order(np.arange(block_k, dtype=np.int32))


def permute_fp4_activations(a: jax.Array, tile: SlotTile) -> jax.Array:
    """``a [R, K]`` -> the FP4 kernels' column order for ``tile``'s K steps, ``[R, steps *
    block_k]`` (a ragged K zero-padded to whole steps first)."""
    r, k = a.shape
    bk = tile.block_k
    steps = num_k_steps(k, tile)
    a = jnp.pad(a, ((0, 0), (0, steps * bk - k)))
    return _to_operand_order(a.reshape(r, steps, bk)).reshape(r, steps * bk)


def _natural_order(a: jax.Array, tile: SlotTile) -> jax.Array:
    """The inverse of ``permute_fp4_activations`` (tests)."""
    r, k = a.shape
    bk = tile.block_k
    inverse = np.argsort(fp4_operand_order(bk))
    return a.reshape(r, k // bk, bk)[:, :, inverse].reshape(r, k)


def _group_size(fmt: str) -> int:
    return 16 if fmt == "nvfp4" else 32


def _fp4_scale_bits_jnp(scale_ref, e, n0, kb, *, fmt: str, tile: SlotTile):
    """Interpret mode's ``_fp4_scale_bits_inline``: step ``kb``'s scale bytes ``[bn,
    groups]``."""
    groups = tile.block_k // _group_size(fmt)
    return scale_ref[e, pl.ds(n0, BLOCK_N), pl.ds(kb * groups, groups)]


def _fp4_factors_jnp(s, *, fmt: str, top=None):
    """Interpret mode's ``_fp4_factors_inline``: the scale bytes ``s [bn, groups]`` -> the
    factors as a ``[bn, bk]`` f16 array in operand order (MXFP4: against the rows' ``top``
    bytes, ``_mx_row_top_jnp``)."""
    size = _group_size(fmt)

    def per_column(f):  # [bn, groups] -> [bn, bk] in operand order
        return _to_operand_order(jnp.repeat(f, size, axis=1))

    if fmt == "nvfp4":
        return per_column(s.astype(jnp.float16))
    return per_column(e8m0_step_to_f16(s.astype(jnp.int32) - top[:, None]))


def _e2m1_as_e4m3(codes):
    """int32 E2M1 codes (low 4 bits) -> float8_e4m3fn ``e2m1 * 2^-6`` by bit placement (sign
    to bit 7, the magnitude bits to 4-2), as the kernels' byte-wise placement."""
    bits = ((codes & 7) << 2) | ((codes & 8) << 4)
    return lax.bitcast_convert_type(bits.astype(jnp.uint8), jnp.float8_e4m3fn)


def _fp4_operands_jnp(w_smem, factors):
    """Interpret mode's ``_fp4_operands_inline``: the same operands by jnp."""
    codes = w_smem[...].astype(jnp.int32)  # [bn, bk / 2]
    bn, bk = codes.shape[0], 2 * codes.shape[1]
    nibbles = jnp.stack([codes & 15, codes >> 4], axis=-1).reshape(bn, bk)  # K order
    return _to_operand_order(_e2m1_as_e4m3(nibbles).astype(jnp.float16)) * factors


def _splat_f16x2(bits, half: int = 0):
    """i32 holding two f16 -> vector<2xf16> holding half ``half`` (0: the low) twice: a lane
    shuffle, which ptxas folds into the HMUL2 that reads it (an operand's ``.H0_H0`` /
    ``.H1_H1``), no instruction of its own."""
    pair = mgpu.utils.bitcast(bits, ir.VectorType.get((2,), ir.F16Type.get()))
    return vector.shuffle(pair, pair, [half, half])


_ROW_CARRIER = plgpu.Layout.WGMMA.reduce(1)  # [bn] f32: one register a thread's row half


def _row_carrier(regs):
    """A thread's two row-half i32 values as a ``[bn]`` f32 WGMMA-row array (their bits)."""
    out = np.empty(mgpu.WGMMA_ROW_LAYOUT.registers_shape((BLOCK_N,)), object)
    for i, v in enumerate(regs):
        out[0, 0, i, 0, 0] = mgpu.utils.bitcast(v, ir.VectorType.get((1,), ir.F32Type.get()))
    return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_ROW_LAYOUT, _is_signed=None)


def _row_bits(carrier, i):
    """Row half ``i``'s i32 from a ``_row_carrier`` array."""
    reg = vector.extract(carrier.registers[0, 0, i, 0, 0], dynamic_position=[],
                         static_position=ir.DenseI64ArrayAttr.get([0]))
    return arith.bitcast(ir.IntegerType.get_signless(32), reg)


def _window_factors_inline(factor_ref, row0, wn: int):
    """``[bn, wn]`` f32 (WGMMA layout), column j ``factor_ref[row0 + j]``: the ``wn`` window
    rows' factors (``row0`` a multiple of 8), each a thread's two columns by one 8-byte load."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT),
                       return_type=plgpu.ShapeDtypeStruct((BLOCK_N, wn), jnp.float32,
                                                          layout=plgpu.Layout.WGMMA))
    def load(_, ref, first):
        f32x2 = ir.VectorType.get((2,), ir.F32Type.get())
        _, _, _, quad = _thread_rows()
        ptr = mgpu.utils.memref_ptr(ref)
        # register [0, j, 0, 0, i, ...]: row half i, columns 8j + 2c, 8j + 2c + 1
        regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((BLOCK_N, wn)), object)
        at = arith.addi(first.registers.item(), arith.muli(quad, _i32(2)))
        for j in range(wn // 8):
            pair = _load(ptr, arith.muli(arith.addi(at, _i32(8 * j)), _i32(4)), f32x2)
            for i in range(2):
                regs[0, j, 0, 0, i, 0, 0, 0, 0] = pair
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return load(factor_ref, jnp.asarray(row0, jnp.int32))


_BIAS_TYPES = {jnp.dtype(jnp.bfloat16): ir.BF16Type, jnp.dtype(jnp.float16): ir.F16Type,
               jnp.dtype(jnp.float32): ir.F32Type}


def _row_bias_inline(bias_ref, first):
    """``[bn]`` f32 (WGMMA rows): entries ``first + n`` of the flat bias table (bf16, f16 or
    f32), a scalar load a thread's row half."""
    dtype = jnp.dtype(bias_ref.dtype)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT),
                       return_type=plgpu.ShapeDtypeStruct((BLOCK_N,), jnp.float32,
                                                          layout=_ROW_CARRIER))
    def load(_, ref, start):
        f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
        row, _, _, _ = _thread_rows()
        ptr = mgpu.utils.memref_ptr(ref)
        bits = []
        for i in range(2):  # row half
            idx = arith.addi(start.registers.item(), arith.addi(row, _i32(8 * i)))
            v = _load(ptr, arith.muli(idx, _i32(dtype.itemsize)), _BIAS_TYPES[dtype].get())
            if dtype != jnp.float32:
                v = arith.extf(f32, v)
            bits.append(arith.bitcast(i32, v))
        return _row_carrier(bits)

    return load(bias_ref, jnp.asarray(first, jnp.int32))


def _own_mx_groups(bk: int) -> int:
    """E8M0 bytes of its own a thread reads a row a K step (MXFP4): the most groups
    of 32 the ``bk / 4`` columns from ``c bk / 4`` of a quad's thread ``c`` meet (1 at 64 and
    128, 2 at 192 and 256, 3 at 320)."""
    q = bk // 4
    return max(((c + 1) * q - 1) // 32 - c * q // 32 + 1 for c in range(4))


def _fp4_scale_bits_inline(scale_ref, row0, kb, *, fmt: str, tile: SlotTile,
                           ragged: bool = False):
    """Step ``kb``'s scale bytes of a thread's two rows, as loaded (a tuple of ``[bn]`` f32
    carriers holding i32 bits, one a 32-bit word; ``_fp4_factors_inline`` makes the factors):
    NVFP4 the e4m3 bytes of the thread's own groups (1, 2, 3, 4 or 5 at ``bk`` = 64, 128,
    192, 256, 320), MXFP4 those of its own groups (``_own_mx_groups``, from the group of its
    first column). The loads are as wide as the row stride, the byte count and the offsets allow
    (up to 8 bytes; gpt-oss's 90-byte MXFP4 rows: 2). ``scale_ref [E, N, K / 16 | K / 32]``,
    ``row0 = e * N + n0``. ``ragged`` (``_fp4_ragged``): the last step's loads past the row's
    bytes start at its last ``nbytes`` instead (their codes are zeros: any finite factor)."""
    bn, bk = BLOCK_N, tile.block_k
    groups = bk // _group_size(fmt)  # a row's bytes a step
    mx = fmt == "mxfp4"
    nbytes = _own_mx_groups(bk) if mx else groups // 4
    words = -(-nbytes // 4)
    stride = scale_ref.shape[-1]
    unit = 8  # bytes a load: a power of two dividing the row stride and nbytes (and so the
    #   step's and, NVFP4, the thread's offset; MXFP4's own bytes start at 2c only at 256)
    while stride % unit or nbytes % unit or (mx and bk != 256 and unit > 1):
        unit //= 2

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT,
                                  plgpu.Layout.WG_SPLAT),
                       return_type=tuple(plgpu.ShapeDtypeStruct((bn,), jnp.float32,
                                                                layout=_ROW_CARRIER)
                                         for _ in range(words)))
    def load(_, ref, first_row, first_col):
        i32 = ir.IntegerType.get_signless(32)
        row, _, _, quad = _thread_rows()
        ptr = mgpu.utils.memref_ptr(ref)
        bits = [[] for _ in range(words)]  # [word][row half]
        for i in range(2):  # row half
            r = arith.addi(first_row.registers.item(), arith.addi(row, _i32(8 * i)))
            base = arith.muli(r, _i32(stride))
            at = arith.addi(base, first_col.registers.item())
            if fmt == "nvfp4":  # the thread's first group: quad * (bk / 4) / 16
                own = arith.muli(quad, _i32(bk // 64))
            else:  # the group of its first column: quad * (bk / 4) / 32
                own = arith.divui(arith.muli(quad, _i32(bk // 4)), _i32(32))
            if ragged:  # the row's last bytes for a step past them
                at = arith.addi(base, arith.minui(arith.addi(first_col.registers.item(), own),
                                                  _i32(stride - nbytes)))
            else:
                at = arith.addi(at, own)
            half = [None] * words
            for j in range(nbytes // unit):
                here = arith.addi(at, _i32(j * unit)) if j else at
                if unit >= 4:
                    vec = _load(ptr, here, ir.VectorType.get((unit // 4,), i32))
                    for w in range(unit // 4):
                        half[j * unit // 4 + w] = vector.extract(
                            vec, dynamic_position=[],
                            static_position=ir.DenseI64ArrayAttr.get([w]))
                    continue
                piece = arith.extui(i32, _load(ptr, here, ir.IntegerType.get_signless(8 * unit)))
                w, shift = divmod(j * unit, 4)
                if shift:
                    piece = arith.shli(piece, _i32(8 * shift))
                half[w] = piece if half[w] is None else arith.ori(half[w], piece)
            for w in range(words):
                bits[w].append(half[w])
        return tuple(_row_carrier(b) for b in bits)

    return load(scale_ref, jnp.asarray(row0, jnp.int32), jnp.asarray(kb * groups, jnp.int32))


def _factor_slots(bk: int) -> int:
    """Factor slots a thread holds a row half: one for each two of its 32-bit code words
    (its 16 operand columns of one NVFP4 group); at least two (the carrier's columns)."""
    return max(bk // 64, 2)


def _fp4_factors_inline(bits, *, fmt: str, tile: SlotTile, top=None):
    """A step's factors from its scale bytes (``_fp4_scale_bits_inline``), per thread: a
    ``[bn, 8 * slots]`` f16 WGMMA-layout array used as a carrier (register ``[.., s, .., i,
    ..]`` = the factor of the thread's row half ``i`` and words ``2s, 2s + 1`` of its codes;
    not a logical array); MXFP4's against ``top`` (``_mx_row_top_inline``'s
    carrier: each row's largest byte of the program)."""
    bn, bk = BLOCK_N, tile.block_k
    size = _group_size(fmt)
    slots = _factor_slots(bk)
    used = bk // 64  # slots holding words (bk = 64: 2 words, slot 0)
    mx = fmt == "mxfp4"
    if mx == (top is None):
        raise ValueError("_fp4_factors_inline: MXFP4 takes the rows' top bytes, NVFP4 none")
    ret = plgpu.ShapeDtypeStruct((bn, 8 * slots), jnp.float16, layout=plgpu.Layout.WGMMA)
    tops = () if top is None else (top,)

    @plgpu.inline_mgpu(arg_types=(_ROW_CARRIER,) * (len(bits) + len(tops)), return_type=ret)
    def convert(_, *carriers):
        i16, i32 = (ir.IntegerType.get_signless(b) for b in (16, 32))
        _, _, _, quad = _thread_rows()
        first = arith.muli(quad, _i32(bk // 4))  # the thread's first column of the step
        factors = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((bn, 8 * slots)), object)
        for i in range(2):  # row half
            words = [_row_bits(c, i) for c in carriers[:len(bits)]]
            if not mx:  # e4m3 bytes of the thread's groups, in order: two a cvt
                per_slot = []
                for half in range(-(-used // 2)):
                    pair = words[half // 2]
                    if half % 2:
                        pair = arith.shrui(pair, _i32(16))
                    f = mgpu.utils.inline_ptx("cvt.rn.f16x2.e4m3x2 $0, $1;",
                                              arith.trunci(i16, pair), result_types=i32)
                    per_slot += [_splat_f16x2(f, 0), _splat_f16x2(f, 1)]
                per_slot = per_slot[:used]
            else:  # each slot's own group's E8M0 byte against the row's largest
                top_ = _row_bits(carriers[-1], i)
                per_slot, made = [], {}
                for slot in range(used):
                    # where the thread's columns start a group (bk = 128, 256), slots 2g and
                    # 2g + 1 lie in one and share its factor
                    key = (16 * slot) // size if (bk // 4) % size == 0 else slot
                    if key not in made:  # the group of the slot's first column
                        idx = arith.divui(arith.addi(first, _i32(16 * slot)), _i32(size))
                        # the thread's own bytes, from its first column's
                        idx = arith.subi(idx, arith.divui(first, _i32(size)))
                        word = words[0]
                        for w in range(1, len(words)):  # byte idx of the words
                            word = arith.select(
                                arith.cmpi(arith.CmpIPredicate.uge, idx, _i32(4 * w)),
                                words[w], word)
                        if len(words) > 1:
                            idx = arith.andi(idx, _i32(3))
                        mine = arith.andi(arith.shrui(word, arith.muli(idx, _i32(8))),
                                          _i32(0xFF))
                        # 2^(mine - top) <= 1 as f32 (0 below 2^-126), rounded to f16 by cvt:
                        # the f16 of e8m0_step_to_f16 (subnormal down to 2^-24, 0 below)
                        exp = arith.maxsi(arith.addi(arith.subi(mine, top_), _i32(127)),
                                          _i32(0))
                        f32 = arith.bitcast(ir.F32Type.get(), arith.shli(exp, _i32(23)))
                        f16 = arith.truncf(ir.F16Type.get(), f32)
                        made[key] = _splat_f16x2(arith.extui(i32, arith.bitcast(i16, f16)))
                    per_slot.append(made[key])
            per_slot += [per_slot[0]] * (slots - len(per_slot))  # unused slots: any value
            for s_, f in enumerate(per_slot):
                factors[0, s_, 0, 0, i, 0, 0, 0, 0] = f
        return mgpu.FragmentedArray(_registers=factors, _layout=mgpu.WGMMA_LAYOUT,
                                    _is_signed=None)

    return convert(*bits, *tops)


def _bytes_max(top, word, nbytes: int = 4):
    """The largest of i32 ``top`` and the ``nbytes`` low bytes of i32 ``word`` (unsigned)."""
    for b in range(nbytes):
        top = arith.maxui(top, arith.andi(arith.shrui(word, _i32(8 * b)), _i32(0xFF)))
    return top


def _row_factor_bits(top):
    """i32 E8M0 byte ``top`` -> the f32 bits of ``2^(top - 127 + PLACEMENT)`` (inf past 254)."""
    return arith.shli(arith.minui(arith.addi(top, _i32(_PLACEMENT)), _i32(255)), _i32(23))


def _mx_row_top_inline(scale_ref, row0, first_group, *, groups: int, step_groups: int,
                       ragged: bool = False):
    """MXFP4: the largest E8M0 byte of each of a thread's two rows over the
    program's ``groups`` bytes of them from ``first_group`` (a multiple of ``step_groups``, a K
    step's): a ``[bn]`` carrier of i32 bits (``_mx_row_factor_inline`` makes the factor). The
    four threads of a quad (which hold the same rows) take every fourth load (as wide as the
    row stride and the counts allow, up to 8 bytes; past the last load, the last again) and
    meet by two butterfly shuffles. ``row0 = e * N + n0``. ``ragged``: loads past the row's
    bytes (a ragged last step's) read its last ones again."""
    bn = BLOCK_N
    stride = scale_ref.shape[-1]
    unit = 8
    while stride % unit or groups % unit or step_groups % unit:
        unit //= 2
    loads = groups // unit
    carrier = plgpu.ShapeDtypeStruct((bn,), jnp.float32, layout=_ROW_CARRIER)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT,
                                  plgpu.Layout.WG_SPLAT), return_type=carrier)
    def load(_, ref, first_row, first_col):
        i32 = ir.IntegerType.get_signless(32)
        row, _, _, quad = _thread_rows()
        ptr = mgpu.utils.memref_ptr(ref)
        tops = []
        for i in range(2):  # row half
            r = arith.addi(first_row.registers.item(), arith.addi(row, _i32(8 * i)))
            base = arith.muli(r, _i32(stride))
            at = arith.addi(base, first_col.registers.item())
            top = _i32(0)
            for m in range(-(-loads // 4)):
                j = arith.minui(arith.addi(quad, _i32(4 * m)), _i32(loads - 1))
                if ragged:  # the row's last load for a load past its bytes
                    col = arith.addi(first_col.registers.item(), arith.muli(j, _i32(unit)))
                    here = arith.addi(base, arith.minui(col, _i32(stride - unit)))
                else:
                    here = arith.addi(at, arith.muli(j, _i32(unit)))
                if unit == 8:
                    vec = _load(ptr, here, ir.VectorType.get((2,), i32))
                    words = [vector.extract(vec, dynamic_position=[],
                                            static_position=ir.DenseI64ArrayAttr.get([w]))
                             for w in range(2)]
                else:
                    word = _load(ptr, here, ir.IntegerType.get_signless(8 * unit))
                    words = [word if unit == 4 else arith.extui(i32, word)]
                for word in words:
                    top = _bytes_max(top, word, min(unit, 4))
            for d in (1, 2):  # the quad's lanes
                top = arith.maxui(top, mgpu.utils.shfl_bfly(top, d))
            tops.append(top)
        return _row_carrier(tops)

    return load(scale_ref, jnp.asarray(row0, jnp.int32), jnp.asarray(first_group, jnp.int32))


def _mx_row_factor_inline(top):
    """``_mx_row_top_inline``'s carrier -> the rows' ``2^(top - 127 + PLACEMENT)`` (``[bn]``
    f32), made after the K steps (two registers fewer live through them)."""

    @plgpu.inline_mgpu(arg_types=(_ROW_CARRIER,), return_type=plgpu.ShapeDtypeStruct(
        (BLOCK_N,), jnp.float32, layout=_ROW_CARRIER))
    def factor(_, carrier):
        return _row_carrier([_row_factor_bits(_row_bits(carrier, i)) for i in range(2)])

    return factor(top)


def _mx_row_top_jnp(scale_ref, e, n0, first_group, *, groups: int):
    """Interpret mode's ``_mx_row_top_inline``: ``[bn]`` int32."""
    return jnp.max(scale_ref[e, pl.ds(n0, BLOCK_N), pl.ds(first_group, groups)].astype(jnp.int32),
                   axis=1)


def _mx_row_factor_jnp(top):
    """Interpret mode's ``_mx_row_factor_inline``."""
    return e8m0_to_f32(jnp.minimum(top + _PLACEMENT, 255))


def _fp4_word_to_f16x2(word):
    """A 32-bit word of 8 E2M1 nibbles -> its four f16x2 registers (i32), yielded as (column
    block 2hh + j of the word's 16 operand columns, register); see the comment above."""
    i32 = ir.IntegerType.get_signless(32)
    low = arith.ori(  # e4m3 bytes of n0, n2, n4, n6 (_e2m1_as_e4m3)
        arith.shli(arith.andi(word, _i32(0x07070707)), _i32(2)),
        arith.shli(arith.andi(word, _i32(0x08080808)), _i32(4)))
    high = arith.ori(  # of n1, n3, n5, n7
        arith.andi(arith.shrui(word, _i32(2)), _i32(0x1C1C1C1C)),
        arith.andi(word, _i32(0x80808080)))
    for hh, e4m3 in enumerate((low, high)):  # (n0, n2), (n4, n6); (n1, n3), (n5, n7)
        pairs = mgpu.utils.inline_ptx(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            e4m3, result_types=[i32, i32])
        for j, pair in enumerate(pairs):
            yield 2 * hh + j, pair


def _fp4_operands_inline(w_smem, factors, *, tile: SlotTile, k: int | None = None,
                         part: int = 0, parts: int = 1):
    """The code tile ``w_smem [bn, bk / 2]`` (``_code_transforms(bk, k)``) -> the f16 A operand
    ``[bn, bk]`` (WGMMA layout) with the step's factors (``_fp4_factors_inline``'s carrier)
    multiplied in; its columns hold K columns ``fp4_operand_order``. ``parts`` > 1: only
    operand columns ``[part * bk / parts, (part + 1) * bk / parts)``, ``[bn, bk / parts]`` (a
    thread's words of that part: its loads of that part's bytes)."""
    bn, bk = BLOCK_N, tile.block_k
    per_part = bk // 8 // parts  # bytes a thread reads of a row for one part
    if bk // 8 % parts or per_part % 8:
        raise ValueError(f"{parts} parts of a K step of {bk}: expected parts of a multiple of 8 "
                         f"bytes of a thread's row each")
    load_bytes = 16 if per_part % 16 == 0 else 8  # SMEM loads of 16 bytes (8 where they must)
    loads = range(part * per_part // load_bytes, (part + 1) * per_part // load_bytes)
    cols = bk // parts
    operand = plgpu.ShapeDtypeStruct((bn, cols), jnp.float16, layout=plgpu.Layout.WGMMA)
    row_bytes = bk // 2
    transforms = _code_transforms(bk, k)
    swizzle = transforms[1].swizzle  # 8-row tiles this wide

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms), plgpu.Layout.WGMMA),
                       return_type=operand)
    def convert(_, ref, fac):
        i32 = ir.IntegerType.get_signless(32)
        f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
        row, _, _, quad = _thread_rows()
        ptr = mgpu.utils.memref_ptr(ref)
        # register [0, b, 0, 0, i, ...]: row half i, columns 8b + 2c, 8b + 2c + 1
        regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((bn, cols)), object)
        first = arith.muli(quad, _i32(bk // 8))  # the thread's first byte of a row
        for i in range(2):
            r = arith.addi(row, _i32(8 * i))
            vals = []
            for j in loads:
                # byte b = first + j * load_bytes of row r: tiles of 8 rows x swizzle bytes
                # (row tile, then column tile), in a tile byte t = (r % 8) * swizzle + b %
                # swizzle, its 16-byte chunk XOR-ed with (t // 128) % (swizzle // 16) (Mosaic
                # GPU's swizzle): each 16 bytes is its own load
                b = arith.addi(first, _i32(j * load_bytes)) if j else first
                t = arith.addi(arith.muli(arith.remui(r, _i32(8)), _i32(swizzle)),
                               arith.remui(b, _i32(swizzle)))
                chunk = arith.remui(arith.shrui(t, _i32(7)), _i32(swizzle // 16))
                t = arith.xori(t, arith.shli(chunk, _i32(4)))
                tile_at = arith.addi(arith.muli(arith.divui(r, _i32(8)), _i32(8 * row_bytes)),
                                     arith.muli(arith.divui(b, _i32(swizzle)), _i32(8 * swizzle)))
                vec = _load(ptr, arith.addi(tile_at, t), ir.VectorType.get((load_bytes // 4,), i32))
                vals += [vector.extract(vec, dynamic_position=[],
                                        static_position=ir.DenseI64ArrayAttr.get([w]))
                         for w in range(load_bytes // 4)]
            skip = part * per_part // 4  # the thread's words of the row before the part's
            for w, word in enumerate(vals, start=skip):
                # words 2s, 2s + 1 lie in the scale group of the carrier's slot s (NVFP4; an
                # MXFP4 group spans two slots, which hold the same factor)
                f = fac.registers[0, w // 2, 0, 0, i, 0, 0, 0, 0]
                for col_block, pair in _fp4_word_to_f16x2(word):
                    val = arith.mulf(mgpu.utils.bitcast(pair, f16x2), f)
                    regs[0, 4 * (w - skip) + col_block, 0, 0, i, 0, 0, 0, 0] = val
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return convert(w_smem, factors)


_W_DTYPE = {"bf16": (jnp.bfloat16,), "fp8": (jnp.float8_e4m3fn,),
            "nvfp4": (jnp.uint8,), "mxfp4": (jnp.uint8,)}
FORMATS = tuple(_W_DTYPE)  # the kernels' format names
# formats whose K need not be a multiple of block_k (a multiple of 64: a ragged last step; FP4's
# activation order and scale loads work in whole steps)
_RAGGED_FORMATS = ("bf16", "fp8")
# formats that take K steps of 256 (where they divide K): a step's fixed cost (the pipeline's
# barriers and TMA issue, the loop, the scale loads) over twice the codes
_WIDE_FORMATS = ("nvfp4", "mxfp4")


def _takes_ragged_k(fmt: str | None, k: int) -> bool:
    """Whether ``fmt`` runs a K that steps of 128 do not divide (a ragged last step)."""
    return fmt in _RAGGED_FORMATS and k % 64 == 0


def _fp4_ragged(fmt: str | None, k: int, block_k: int | None) -> bool:
    """Whether FP4 weights of K run in steps of ``block_k`` = 256 with a ragged last step (K
    a multiple of 64, not of 256)."""
    return fmt in _WIDE_FORMATS and block_k == 256 and k % 64 == 0 and k % block_k != 0


def own_h_takes(fmt: str, k: int, tile: SlotTile) -> bool:
    """Whether a down launch of K (``tile``'s steps) can make its own h (``h_source``): K a
    multiple of the step, or FP4's ragged steps of 256 (h zero past K)."""
    return k % tile.block_k == 0 or _fp4_ragged(fmt, k, tile.block_k)


def down_makes_h(tokens: int, fmt: str, k: int, tile: SlotTile, k_splits: int) -> bool:
    """Whether the decode step's down launch of K (``tile``, K over ``k_splits`` programs) at
    ``tokens`` tokens makes its own h: f16 activations, up to ``DOWN_MAKES_H_TOKENS``, where it
    can (``own_h_takes``) and its h tile is at most ``H_TILE_MAX_BYTES``."""
    tile_bytes = num_k_steps(k, tile) // k_splits * tile.block_k * tile.window * 2
    return (activation_dtype(fmt) == jnp.float16 and tokens <= DOWN_MAKES_H_TOKENS
            and own_h_takes(fmt, k, tile) and tile_bytes <= H_TILE_MAX_BYTES)


def activation_dtype(fmt: str) -> jnp.dtype:
    """The activations' dtype for weights of ``fmt``: bf16 for BF16 weights, else f16 (rows
    scaled into f16 range by a power of two)."""
    return jnp.dtype(jnp.bfloat16 if fmt == "bf16" else jnp.float16)


def unsupported_reason(fmt: str, w_dtype, n: int, k: int, *,
                       fp8_block: tuple[int, int] | None = None, global_rows: int | None = None,
                       tile: SlotTile, experts: int = 1) -> str | None:
    """Why ``slot_matmul`` cannot run a stack of ``experts`` weights of format ``fmt``
    (``FORMATS``) and logical shape ``[N, K]``, or None."""
    if fmt in _WIDE_FORMATS and experts * n * (k // _group_size(fmt)) >= 2**31:
        return (f"scale: {experts} x {n} x {k // _group_size(fmt)} bytes of {fmt} scales; the "
                "kernels' scale loads take byte offsets below 2^31")
    if fmt not in FORMATS:
        return f"fmt: expected one of {FORMATS}, got {fmt!r}"
    w_dtype = jnp.dtype(w_dtype)
    if w_dtype not in [jnp.dtype(d) for d in _W_DTYPE[fmt]]:
        return f"w: dtype {w_dtype} is not {fmt} data"
    if tile.block_k > 128 and fmt not in ("nvfp4", "mxfp4"):
        return f"tile: block_k={tile.block_k} takes NVFP4 or MXFP4 weights, not {fmt}"
    if k % tile.block_k and not (_takes_ragged_k(fmt, k) or _fp4_ragged(fmt, k, tile.block_k)):
        return (f"w: K={k} must be a multiple of block_k={tile.block_k}"
                + (" (or of 64)" if fmt in _RAGGED_FORMATS else "")
                + (" (or of 64 at block_k=256)" if fmt in _WIDE_FORMATS else ""))
    if n % BLOCK_N:
        return f"w: N={n} must be a multiple of {BLOCK_N} (the weight rows a program)"
    if (fp8_block is not None) != (fmt == "fp8"):
        return "fp8_block: FP8 weights take block scales, other formats none"
    if fp8_block is not None:
        b0, b1 = fp8_block
        if b0 % BLOCK_N or b1 % tile.block_k:
            return (f"scale: the FP8 block {fp8_block} must be a multiple of "
                    f"(weight rows a program, block_k) = ({BLOCK_N}, {tile.block_k})")
    if fmt == "nvfp4" and (global_rows is None or global_rows % BLOCK_N):
        return (f"global_scale: NVFP4 row segments of {global_rows} rows must be a multiple of "
                f"{BLOCK_N} (one global scale a program)")
    return None


def _stack_operands(w, scale, global_scale, extra, *, fmt, fp8_block, tile: SlotTile,
                    k_splits: int, interpret: bool):
    """One launch's weight stacks checked: ``(fmt, N, K, global_rows, operands, pad_k)``, the
    operands as ``_kernel`` takes them (per stack w, [scale], [global]), ``pad_k`` the
    interpreter's twin of the TMA's zero fill past K (identity when compiled)."""
    if w.ndim != 3:
        raise ValueError(f"w: expected rank 3, got shape {w.shape}")
    fmt = format_name(fmt, w.dtype)
    fp4 = fmt in ("nvfp4", "mxfp4")
    _, n, k = w.shape
    k = 2 * k if fp4 else k
    global_rows = None
    if fmt == "nvfp4":
        if global_scale is None:
            raise ValueError("global_scale: NVFP4 needs [E, R] f32 global scales")
        global_rows = n // global_scale.reshape(w.shape[0], -1).shape[1]
    reason = unsupported_reason(fmt, w.dtype, n, k, fp8_block=fp8_block,
                                global_rows=global_rows, tile=tile,
                                experts=max(w.shape[0], extra[0].shape[0] if extra else 0))
    if reason:
        raise NotImplementedError(reason)
    steps = num_k_steps(k, tile)
    if not isinstance(k_splits, int) or k_splits < 1 or steps % k_splits:
        raise ValueError(f"k_splits: expected a positive int dividing the {steps} K steps, got "
                         f"{k_splits!r}")

    def scale_shape(e):
        match fmt:
            case "fp8":
                return (e, pl.cdiv(n, fp8_block[0]), pl.cdiv(k, fp8_block[1])), jnp.float32
            case "nvfp4":
                return (e, n, k // 16), jnp.float8_e4m3fn
            case "mxfp4":
                return (e, n, k // 32), jnp.uint8
        return None, None

    ragged = steps * tile.block_k - k

    def pad_k(v, per: int = 1):
        """The interpreter's twin of the TMA's zero fill past K (it would clamp a ragged last
        step's slice): ``v``'s last axis (``per`` K columns an element) zero-padded to whole
        steps; compiled: ``v``. FP4 scales so padded are zero (their codes too)."""
        pad = ragged // per
        return jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, pad)]) if interpret and pad else v

    stacks = [("", (w, scale, global_scale))]
    if extra is not None:
        stacks.append(("extra_", tuple(extra) + (None,) * (3 - len(extra))))
    operands = []
    for prefix, (ws, ss, gs) in stacks:
        if ws.ndim != 3 or ws.shape[1:] != w.shape[1:] or ws.dtype != w.dtype:
            raise ValueError(f"{prefix}w: expected [E, {n}, {w.shape[2]}] {w.dtype}, got "
                             f"{ws.shape} {ws.dtype}")
        operands.append(pad_k(ws, 2 if fp4 else 1))
        want, dtype = scale_shape(ws.shape[0])
        if want is None:
            if ss is not None:
                raise ValueError(f"{prefix}scale: 16-bit weights take no scale")
            continue
        if ss is None or ss.shape != want or (fp4 and ss.dtype != dtype):
            raise ValueError(f"{prefix}scale: expected {want} {jnp.dtype(dtype)}, got "
                             f"{None if ss is None else (ss.shape, ss.dtype)}")
        operands.append(pad_k(ss.astype(dtype), _group_size(fmt)) if fp4 else ss.astype(dtype))
        if fmt == "nvfp4":
            if gs is None or gs.reshape(ws.shape[0], -1).shape[1] != n // global_rows:
                raise ValueError(f"{prefix}global_scale: expected [{ws.shape[0]}, "
                                 f"{n // global_rows}] f32")
            operands.append(gs.reshape(ws.shape[0], -1).astype(jnp.float32))
    return fmt, n, k, global_rows, operands, pad_k


def _w_stage(tile: SlotTile, dtype):
    """Interpret mode's SMEM for the weight operand (``_matmul_program``'s ``w_stage``)."""
    dtype = jnp.dtype(dtype)
    return plgpu.SMEM((BLOCK_N, tile.block_k), dtype, transforms=_transforms(
        tile.block_k * dtype.itemsize, dtype.itemsize))


def _checked_bias(bias, e: int, n: int):
    if bias.shape != (e, n) or jnp.dtype(bias.dtype) not in _BIAS_TYPES:
        raise ValueError(f"bias: expected [{e}, {n}] bfloat16, float16 or float32, "
                         f"got {bias.shape} {bias.dtype}")
    return bias


class HSource(NamedTuple):
    """``slot_matmul``'s ``h_source``: its ``a`` is the gate_up launch's stacked output ``[splits
    * R, 2I]`` f32 and each program makes its own h from it (``DOWN_MAKES_H_TOKENS``)."""

    splits: int
    activation: Activation
    layout: GateUpLayout
    limit: float | None
    alpha: float


@functools.partial(jax.jit, static_argnames=("fmt", "fp8_block", "tile", "k_splits",
                                             "sum_splits", "h_source", "interpret"))
def slot_matmul(
    work: jax.Array,  # [3, W] int32: expert (>= E: unused), first sorted row, row count <=
    #   tile.rows
    a: jax.Array,  # [R, K] (activation_dtype), sorted rows; R >= window_rows(P, tile.rows)
    #   for items over the rows [0, P); FP4: permute_fp4_activations(., tile) (a ragged K's
    #   rows zero-padded to whole K steps)
    w: jax.Array,  # [E, N, K] e4m3 | bf16, or FP4 codes [E, N, K/2] u8
    scale: jax.Array | None = None,  # FP8: [E, cdiv(N, b0), cdiv(K, b1)] f32; NVFP4:
    #   [E, N, K/16] e4m3; MXFP4: [E, N, K/32] u8 (E8M0)
    extra: tuple | None = None,  # (w, scale, global_scale) of a second stack [E2, ...] likewise:
    #   expert ids E .. E + E2 - 1
    global_scale: jax.Array | None = None,  # NVFP4: [E, R] f32, row n uses segment n // (N // R)
    *,
    row_factor: jax.Array | None = None,  # [R] f32: row r of out times row_factor[r]
    bias: jax.Array | None = None,  # [E, N] bf16 | f16 | f32: the main stack's rows, added
    fmt: str | None = None,  # FORMATS; None: from w's dtype (e4m3: fp8, 16-bit: bf16)
    fp8_block: tuple[int, int] | None = None,
    tile: SlotTile = SlotTile(),
    k_splits: int = 1,
    sum_splits: bool = True,
    h_source: HSource | None = None,  # a: gate_up's output; each program makes its h
    interpret: bool = False,
) -> jax.Array:
    """``out [R, N]`` f32 in sorted-row order, row for row with ``a`` (see the module
    docstring; rows no item owns are not written). Items own rows below ``P`` where ``R >=
    window_rows(P, tile.rows)`` and items of at most ``tile.rows`` rows (every item inside its
    window, every window inside ``a``: the caller's contract, data-dependent).
    The epilogue: ``out[r] = acc[r] * row_factor[r] + bias[e]`` for row r of an item of expert
    e (the factor undoes the activation rows' scaling into f16; the bias is the main stack's,
    and the extra stack's rows get none).
    ``k_splits`` > 1 splits K over that many programs per (item, 64 weight rows), each with its own
    output rows, summed here (more programs for few tokens; ``sum_splits=False``: returned
    stacked, ``[k_splits * R, N]``, the bias in split 0's); it must divide ``K / block_k``.
    ``h_source`` (``DOWN_MAKES_H_TOKENS``; f16 activations, K a multiple of ``block_k`` or FP4's
    ragged steps of 256, whose h past K is zero): ``a``
    is the gate_up launch's stacked output ``[h_source.splits * R, 2K]`` f32, and each program
    makes its window's h for its own K steps (``rows.h_rows``' math, scaled against those columns'
    max) in SMEM, the row factors with it; ``row_factor`` must be None.
    ``interpret=True`` runs the Mosaic GPU interpreter (CPU tests)."""
    if a.ndim != 2:
        raise ValueError(f"a: expected rank 2, got shape {a.shape}")
    if work.ndim != 2 or work.shape[0] != 3:
        raise ValueError(f"work: expected shape (3, W), got {work.shape}")
    rows_a = a.shape[0] // (h_source.splits if h_source else 1)
    if rows_a < tile.window:
        raise ValueError(f"a: expected at least {tile.window} rows (one window of "
                         f"tile.rows={tile.rows}), got {rows_a}")
    fmt, n, k, global_rows, operands, pad_k = _stack_operands(
        w, scale, global_scale, extra, fmt=fmt, fp8_block=fp8_block, tile=tile,
        k_splits=k_splits, interpret=interpret)
    h_from = None
    if h_source is None:  # FP4 over a ragged K: its rows padded to whole steps by the caller
        width = num_k_steps(k, tile) * tile.block_k if fmt in _WIDE_FORMATS else k
        want_a, a_dtype = (rows_a, width), activation_dtype(fmt)
    else:
        want_a, a_dtype = (h_source.splits * rows_a, 2 * k), jnp.dtype(jnp.float32)
        if (activation_dtype(fmt) != jnp.float16 or not own_h_takes(fmt, k, tile)
                or row_factor is not None):
            raise ValueError(f"h_source: f16 activations (not {fmt}), K={k} a multiple of "
                             f"block_k={tile.block_k} (FP4: or ragged at 256), and no "
                             f"row_factor")
        h_from = dict(splits=h_source.splits, rows=rows_a, layout=h_source.layout,
                      activation=h_source.activation, limit=h_source.limit,
                      alpha=h_source.alpha, block_k=tile.block_k if fmt in _WIDE_FORMATS
                      else None)
    if a.shape != want_a or a.dtype != a_dtype:
        raise ValueError(f"a: expected {want_a} {a_dtype}, got {a.shape} {a.dtype}")
    epilogue = []
    if row_factor is not None:
        if row_factor.shape != (rows_a,) or row_factor.dtype != jnp.float32:
            raise ValueError(f"row_factor: expected [{rows_a}] float32, got {row_factor.shape} "
                             f"{row_factor.dtype}")
        epilogue.append(row_factor)
    if bias is not None:
        epilogue.append(_checked_bias(bias, w.shape[0], n))
    bn = BLOCK_N
    stage = [_w_stage(tile, activation_dtype(fmt))] if interpret else []
    kernel = plgpu.kernel(
        functools.partial(_kernel, tile=tile, fmt=fmt, fp8_block=fp8_block,
                          global_rows=global_rows or 0, k=k, num_stacks=1 + (extra is not None),
                          k_splits=k_splits, row_factor=row_factor is not None,
                          bias=bias is not None, h_from=h_from),
        out_type=jax.ShapeDtypeStruct((k_splits * rows_a, n), jnp.float32),
        # the items on the first axis (CUDA's x: the block scheduler's fastest), so resident
        # CTAs read a few tiles of every expert; tiles first measured 1-3% slower (H200: NOTES)
        grid=(work.shape[1], n // bn) + ((k_splits,) if k_splits > 1 else ()),
        grid_names=("w", "n") + (("s",) if k_splits > 1 else ()),
        scratch_types=stage,
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    out = kernel(work, a if h_source or fmt in _WIDE_FORMATS else pad_k(a), *operands,
                 *epilogue)
    if k_splits == 1 or not sum_splits:
        return out
    return out.reshape(k_splits, rows_a, n).sum(axis=0)


def slot_matmul_reference(work, a, w, scale=None, global_scale=None, *, row_factor=None,
                          bias=None, fmt: str | None = None, fp8_block=None) -> jax.Array:
    """Plain jnp: ``[R, N]`` f32, every row of every item (rows no item owns: 0); ``a`` in the
    natural K order (``slot_matmul`` takes FP4 activations permuted)."""
    fmt = format_name(fmt, w.dtype)
    wfmt = {name: f for f, name in _FMT_NAMES.items()}[fmt]
    wf = dequantize_weights(w, wfmt, scale=scale, global_scale=global_scale,
                            block_size=fp8_block or (128, 128))  # [E, N, K] f32
    af = a.astype(jnp.float32)
    r = jnp.arange(a.shape[0], dtype=jnp.int32)
    expert, start, count = work
    owner = (r[:, None] >= start[None, :]) & (r[:, None] < (start + count)[None, :])  # [R, W]
    e = jnp.sum(jnp.where(owner, expert[None, :], 0), axis=1)  # [R]
    owned = jnp.any(owner, axis=1)
    e = jnp.clip(e, 0, w.shape[0] - 1)
    out = jnp.einsum("pk,pnk->pn", af, wf[e], precision=jax.lax.Precision.HIGHEST)
    if row_factor is not None:
        out = out * row_factor[:, None]
    if bias is not None:
        out = out + bias.astype(jnp.float32)[e]
    return jnp.where(owned[:, None], out, 0.0)


# ---------------------------------------------------------------------------------------------
# One launch for gate_up, h and down (``slot_mlp``).
# ---------------------------------------------------------------------------------------------
#
# A 1-D grid: every gate_up program (item, 64 columns, K split; an item's together), then every
# item's cdiv(rows, H_PROGRAM_ROWS) h programs, then every item's down programs, each phase in item
# order (H200: 2-4 us faster than item by item h then down, whose spinning down programs held
# the slots the next items' h programs needed; NOTES, session 24).
# The GPU starts programs in grid order, so a program only waits for programs started before
# it: an h program for its item's gate_up programs (a GMEM semaphore each signals once
# its TMA stores have completed), a down program for its item's h programs. The semaphores
# (``pl.get_global``: one array for the whole grid) are zero-filled before the launch; the
# interpreter runs programs one after another in grid order and has none.

# moe_decode_mosaic_pairs' default for f16 activations: the one launch from FUSE_MLP_TOKENS[0]
# to [1] tokens. H200 steps, three launches -> one: Qwen3 FP8 8 / 32 / 64 tokens 88.4 -> 86.4 /
# 166 -> 166 / 187 -> 188 us, NVFP4 8 73.3 -> 72.5, gpt-oss FP8 8 217 -> 212 (windows of 24,
# session 24; not re-timed with windows of 16). At 1-2 tokens slower: Qwen3 FP8 1 28.9 -> 31.8,
# 2 39.0 -> 41.0; gpt-oss MXFP4 1 48.9 -> 53.9, and 45.1 -> 47.2 with windows of 8 (session
# 25). Not explained yet: a waiting program polls with one thread (the others at a barrier),
# so its issue slots are few; the down programs' weight stream only starts after their wait.
# From 4 tokens (H100 SXM, busy, one launch against three or two (own h); NOTES sessions
# 38-39), 3 / 4 / 5 / 6 tokens: Qwen3 NVFP4 +2.8 / -2.3 / -6.2 / -11.5%, MXFP4 +2.8 / -4.1 /
# -5.9 / -10.6%, FP8 +2.4 / +1.6 / +0.3 / -6.0%; gpt-oss MXFP4 -7.3 / -8.0 / -11.2 / -7.9%,
# NVFP4 -5.5 / -8.0 / -9.7 / -7.1%, FP8 at 4 -7.2%; DeepSeek-V3 at 3 / 4 / 5 / 6 NVFP4 -5.6 /
# -6.4 / -3.5 / -3.9%, FP8 at 4 / 5 / 6 -3.2 / -2.8 / -1.8%. Qwen3 FP8 at 4 the one loss kept.
# From one token fewer (3) where the down programs would not make their own h
# (``down_makes_h``), so that the other path is three launches, not two: at 3 tokens Qwen3
# has its own h (and loses), gpt-oss (h tiles of 45 KB) and DeepSeek-V3 (32 KB) have not (and
# win). gpt-oss MXFP4 at 2 tokens (no own h) only -1.6%: not taken.
FUSE_MLP_TOKENS = (4, 32)
# The h program's shape. ptxas (sm_90a, offline) counts for Qwen3 FP8 the launch's registers a
# thread: 92 at 1 or 2 rows a program (the slot_matmul kernels alone: 88 / 89), 120 at 4 rows
# (16-byte chunks kept: 4 CTAs an SM on the H200, measured), 133 at 4 rows recomputed, 254 at
# 16; NVFP4 121 (its kernels alone 121), gpt-oss MXFP4 125 at 1 row (124 alone), 187 at 2
# (NOTES, session 23).
H_PROGRAM_ROWS = 1  # rows of an h program (1, 2, 4, 8 or 16): cdiv(rows, this) an item
H_CHUNK = 2  # h columns a thread of the h program loads at a time (2 or 4: 8- or 16-byte loads)
H_KEEP_CHUNKS = 16  # chunks a thread keeps in registers between the max and the stores
# Past H_KEEP_CHUNKS the two passes (max, stores) recompute the chunks in rolled loops of H_ROLL
# chunks an iteration (their loads in flight together): registers against L2 round trips.
# Offline ptxas, the one launch at windows of 8 with H_KEEP_CHUNKS=8 and H_ROLL 1 to 6
# (gpt-oss's 12 chunks a thread rolled; Qwen3's 3 still kept): gpt-oss FP8 115 -> 69 registers
# (its matmuls' 66), NVFP4 109 -> 93, MXFP4 95 (109 -> 104 with per-step factors); at 12 (one
# iteration) 110. H200, H_KEEP_CHUNKS=8 at gpt-oss 8 tokens: FP8 busy 192 -> 199 us, MXFP4 152
# -> 150 (NOTES, session 33): kept at 16.
H_ROLL = 6
FUSED_WAIT = True  # False: the programs skip their waits (wrong results: timing only)


def _h_program_jnp(gu_ref, h_ref, hf_ref, first, count, *, splits: int, rows: int,
                   layout: GateUpLayout, activation: Activation, limit, alpha: float,
                   block_k: int | None):
    """Interpret mode's ``_h_program_inline``: the same rows by jnp (``rows.h_rows``' math);
    ``h_ref``'s columns past I (the interpreter's padding to whole K steps) get zeros."""
    n = min(H_PROGRAM_ROWS, rows)
    at = jnp.minimum(first, rows - n)  # n rows from here hold the program's, inside R
    h = _h_jnp(gu_ref, at, n, splits=splits, rows=rows, layout=layout, activation=activation,
               limit=limit, alpha=alpha)
    new, factor = row_launches.rows_reference(h, block_k)  # FP4: row_width wide
    new = jnp.pad(new, ((0, 0), (0, h_ref.shape[1] - new.shape[1])))
    valid = (at + jnp.arange(n) >= first) & (at + jnp.arange(n) < first + count)
    h_ref[pl.ds(at, n), :] = jnp.where(valid[:, None], new, h_ref[pl.ds(at, n), :])
    hf_ref[pl.ds(at, n)] = jnp.where(valid, factor, hf_ref[pl.ds(at, n)])


def _h_jnp(gu_ref, at, n: int, *, splits: int, rows: int, layout: GateUpLayout,
           activation: Activation, limit, alpha: float):
    """Sorted rows ``[at, at + n)`` of the gate_up output (K-split partials summed) -> ``act(gate)
    * up`` rounded to bf16 ``[n, I]`` f32 (``rows.h_rows``' math)."""
    gu = gu_ref[pl.ds(at, n), :]
    for s in range(1, splits):
        gu = gu + gu_ref[pl.ds(s * rows + at, n), :]
    gate, up = split_gate_up(gu, layout)
    return row_launches._round_to_bf16(_epilogue(gate, up, activation, limit, alpha))


def _h_tile_jnp(gu_ref, row0, k0, *, wn: int, kcols: int, bk: int, splits: int, rows: int,
                layout: GateUpLayout, activation: Activation, limit, alpha: float,
                block_k: int | None):
    """Interpret mode's own-h tile (``_h_program_inline`` with ``tile``) for every
    window row ``row0 .. row0 + wn - 1``: h's columns ``[k0, k0 + kcols)`` (``rows.h_rows``'
    math), scaled against their own max -> (``[kcols / bk, wn, bk]`` f16 in the operand order,
    ``[wn]`` f32 factors)."""
    h = _h_jnp(gu_ref, row0, wn, splits=splits, rows=rows, layout=layout,
               activation=activation, limit=limit, alpha=alpha)
    inter = h.shape[1]  # FP4 over a ragged I: zeros past it, to whole steps
    h = jnp.pad(h, ((0, 0), (0, row_launches.row_width(inter, block_k) - inter)))
    h = lax.dynamic_slice_in_dim(h, k0, kcols, axis=1)
    values, factors = row_launches.rows_reference(h, block_k)
    return values.reshape(wn, kcols // bk, bk).transpose(1, 0, 2), factors


def _f32c(v):
    return arith.constant(ir.F32Type.get(), float(v))


def _act_mlir(g, u, activation: Activation, limit, alpha: float):
    """``_epilogue`` on f32 scalars (MLIR values), in its order of operations."""

    def sigmoid(v):
        one = _f32c(1.0)
        return arith.divf(one, arith.addf(one, mlir_math.exp(arith.negf(v))))

    def clip(v, lo, hi):
        return arith.minimumf(arith.maximumf(v, _f32c(lo)), _f32c(hi))

    match activation:
        case Activation.SILU:
            if limit is not None:
                g, u = arith.minimumf(g, _f32c(limit)), clip(u, -limit, limit)
            return arith.mulf(arith.mulf(g, sigmoid(g)), u)
        case Activation.GELU_TANH:
            cube = arith.mulf(arith.mulf(_f32c(0.044715), g), arith.mulf(g, g))
            inner = arith.mulf(_f32c(_SQRT_2_OVER_PI), arith.addf(g, cube))
            half = arith.mulf(_f32c(0.5), g)
            return arith.mulf(arith.mulf(half, arith.addf(_f32c(1.0), mlir_math.tanh(inner))), u)
        case Activation.GPT_OSS:
            g, u = arith.minimumf(g, _f32c(limit)), clip(u, -limit, limit)
            return arith.mulf(arith.mulf(arith.addf(u, _f32c(1.0)), g),
                              sigmoid(arith.mulf(_f32c(alpha), g)))
    raise NotImplementedError(activation)


def _operand_source_mlir(pos, block_k: int):
    """``rows.operand_source`` on an i32 MLIR value."""

    def div(v, d):
        return arith.divui(v, _i32(d))

    def rem(v, d):
        return arith.remui(v, _i32(d))

    step, q = arith.muli(div(pos, block_k), _i32(block_k)), rem(pos, block_k)
    o, within = div(q, 16), rem(q, 16)
    terms = [step, arith.muli(div(rem(within, 8), 2), _i32(block_k // 4)),
             arith.muli(div(o, 2), _i32(8)), arith.muli(div(within, 8), _i32(4)),
             arith.muli(rem(within, 2), _i32(2)), rem(o, 2)]
    return functools.reduce(arith.addi, terms)


def _h_program_inline(gu_ref, h_ref, hf_ref, first, count, red_ref=None, *, splits: int,
                      rows: int, layout: GateUpLayout, activation: Activation, limit,
                      alpha: float, block_k: int | None, tile: tuple | None = None):
    """An h program (one warpgroup, ``128 / H_PROGRAM_ROWS`` threads a row): sorted rows
    ``[first, first + count)`` (``count <= H_PROGRAM_ROWS``; the threads of rows past it only
    join the barriers) of the gate_up output ``gu_ref [splits * R, 2I]`` f32 (K-split partials
    summed) -> ``act(gate) * up`` rounded to bf16, scaled by a power of two into f16
    (``rows._store_scaled``) into ``h_ref [R, I]`` (FP4 over a ragged K: ``[R, row_width]``,
    the positions whose column is past I zero), the factor into ``hf_ref [R]``. A row's
    thread ``t`` takes chunks of ``H_CHUNK`` columns ``t, t + lanes, ...``, loaded straight from
    global memory (L2; no SMEM), all in flight at once; the row's max |h| by shuffles (and,
    rows wider than a warp, through ``red_ref [4]`` f32 SMEM). The values stay in registers
    up to ``H_KEEP_CHUNKS`` chunks a thread (else both passes recompute them, in rolled loops
    of ``H_ROLL`` chunks an iteration, so only those chunks' loads hold registers). FP4
    (``block_k``): the columns in the operand order, each h column's gate and up by scalar
    loads.

    ``tile = (slot, k0, kcols, wn, bk)`` (a down program's own activations):
    one row (``count`` 1) by all 128 threads, its columns ``[k0, k0 + kcols)`` only, scaled
    against their own max, into window row ``slot`` of ``h_ref``, an SMEM tile ``[kcols / bk,
    wn, bk]`` f16 in the wgmma B operand's layout (8-row, 64-column tiles, 128-byte swizzle),
    the factor into ``hf_ref [wn]`` (SMEM) at ``slot``."""
    inter = gu_ref.shape[1] // 2
    per = H_CHUNK  # h columns a chunk
    lanes = 128 if tile else 128 // H_PROGRAM_ROWS  # threads a row
    warps_a_row = max(lanes // 32, 1)
    kcols = tile[2] if tile else row_launches.row_width(inter, block_k)
    ragged = row_launches.row_width(inter, block_k) != inter  # FP4 rows padded to whole steps
    chunks = kcols // per  # a row's
    lane_chunks = -(-chunks // lanes)
    keep = lane_chunks <= (H_TILE_KEEP_CHUNKS if tile else H_KEEP_CHUNKS)
    rolls = -(-lane_chunks // H_ROLL)  # iterations of the recomputing passes' rolled loops
    interleaved = layout is GateUpLayout.INTERLEAVED
    refs = (gu_ref, h_ref, hf_ref) + ((red_ref,) if warps_a_row > 1 else ())

    splats = 4 if tile else 2  # first, count (, slot, k0)
    ref_types = [plgpu.RefType()] * len(refs)
    if tile:  # the h tile's tiling and swizzle (the wgmma B operand's)
        ref_types[1] = plgpu.RefType(_transforms(tile[4] * 2, 2))

    @plgpu.inline_mgpu(arg_types=(*ref_types, *(plgpu.Layout.WG_SPLAT,) * splats))
    def program(_, *args):
        *mems, first_, count_ = args[:len(refs) + 2]
        i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
        f32v = ir.VectorType.get((per,), f32)
        tid = arith.remui(mgpu.utils.thread_idx(), _i32(128))
        r, lane = arith.divui(tid, _i32(lanes)), arith.remui(tid, _i32(lanes))
        row = arith.addi(first_.registers.item(), r)
        if lanes < 128:  # rows past count (only their threads' loads use them) clamped
            #   inside R: the last item's next row may be R itself
            row = arith.minui(row, _i32(rows - 1))
        gu_ptr, h_ptr, hf_ptr, *red = (mgpu.utils.memref_ptr(v) for v in mems)
        bases = [arith.muli(arith.addi(row, _i32(s * rows)), _i32(2 * inter * 4))
                 for s in range(splits)]

        def scalar(v, j):
            return vector.extract(v, dynamic_position=[],
                                  static_position=ir.DenseI64ArrayAttr.get([j]))

        def summed(col, ty):  # the K-split partials' sum at column col (i32) of the row
            at = arith.muli(col, _i32(4))
            vals = [_load(gu_ptr, arith.addi(b, at), ty) for b in bases]
            return functools.reduce(arith.addf, vals)

        def h_values(i):
            """(first column, the thread's ``per`` h values (f32, rounded to bf16), in range)
            of its chunk i (past the row: chunk 0's, out of range; None: always in range); ``i``
            an int, or an i32 of a rolled loop (in range checked)."""
            rolled = not isinstance(i, int)
            c = arith.addi(lane, arith.muli(i, _i32(lanes)) if rolled else _i32(lanes * i))
            ok = None
            if rolled or (i + 1) * lanes > chunks:  # some thread's chunk past the row
                ok = arith.cmpi(arith.CmpIPredicate.ult, c, _i32(chunks))
                c = arith.select(ok, c, _i32(0))
            pos0 = arith.muli(c, _i32(per))
            if tile:
                pos0 = arith.addi(pos0, args[-1].registers.item())
            if block_k is None and not interleaved:
                g, u = summed(pos0, f32v), summed(arith.addi(pos0, _i32(inter)), f32v)
                pairs = [(scalar(g, j), scalar(u, j)) for j in range(per)]
            elif block_k is None:  # gate and up alternate: 16-byte loads of two pairs
                v = [summed(arith.addi(arith.muli(pos0, _i32(2)), _i32(4 * q)),
                            ir.VectorType.get((4,), f32)) for q in range(per // 2)]
                pairs = [(scalar(v[j // 2], 2 * (j % 2)), scalar(v[j // 2], 2 * (j % 2) + 1))
                         for j in range(per)]
            else:
                pairs, inside = [], []
                for j in range(per):
                    src = _operand_source_mlir(arith.addi(pos0, _i32(j)), block_k)
                    if ragged:  # a column past I: 0 (its loads kept on the row)
                        inside.append(arith.cmpi(arith.CmpIPredicate.ult, src, _i32(inter)))
                        src = arith.select(inside[-1], src, _i32(0))
                    two = arith.muli(src, _i32(2))
                    cols = ((two, arith.addi(two, _i32(1))) if interleaved
                            else (src, arith.addi(src, _i32(inter))))
                    pairs.append(tuple(summed(col, f32) for col in cols))
            vals = [arith.extf(f32, arith.truncf(ir.BF16Type.get(), _act_mlir(
                g, u, activation, limit, alpha))) for g, u in pairs]
            if ragged:
                vals = [arith.select(ok_, v, _f32c(0.0)) for ok_, v in zip(inside, vals,
                                                                            strict=True)]
            return pos0, vals, ok

        def chunk_max(amax, vals, ok):
            for v in vals:
                a = mlir_math.absf(v)
                amax = arith.maximumf(amax, a if ok is None else arith.select(ok, a, _f32c(0)))
            return amax

        kept = [h_values(i) for i in range(lane_chunks)] if keep else None
        amax = _f32c(0.0)
        if keep:
            for _, vals, ok in kept:
                amax = chunk_max(amax, vals, ok)
        else:  # a rolled loop: H_ROLL chunks' loads in flight at a time (registers)
            @mgpu.utils.fori(_i32(rolls), amax)
            def amax(i, amax):
                for j in range(H_ROLL):
                    _, vals, ok = h_values(arith.addi(arith.muli(i, _i32(H_ROLL)), _i32(j)))
                    amax = chunk_max(amax, vals, ok)
                return amax

            amax = amax.result
        d = min(lanes, 32) // 2
        while d:  # the row's lanes of a warp
            amax = arith.maximumf(amax, mgpu.utils.shfl_bfly(amax, d))
            d //= 2
        if warps_a_row > 1:  # across the row's warps: one f32 a warp through SMEM
            warp = arith.divui(tid, _i32(32))
            with mgpu.utils.when(arith.cmpi(arith.CmpIPredicate.eq, arith.remui(tid, _i32(32)),
                                            _i32(0))):
                llvm.store(amax, _gep(red[0], arith.muli(warp, _i32(4))))
            mgpu.utils.warpgroup_barrier()
            mine = arith.muli(arith.divui(warp, _i32(warps_a_row)), _i32(warps_a_row))
            for j in range(warps_a_row):
                other = _load(red[0], arith.muli(arith.addi(mine, _i32(j)), _i32(4)), f32)
                amax = arith.maximumf(amax, other)
        # rows._store_scaled's powers of two (paged_attention.decode._pow2_row_scales)
        e = arith.andi(arith.shrui(arith.bitcast(i32, amax), _i32(23)), _i32(0xFF))
        e = arith.minsi(arith.maxsi(e, _i32(11)), _i32(254))
        up = arith.bitcast(f32, arith.shli(arith.subi(_i32(264), e), _i32(23)))
        down = arith.bitcast(f32, arith.shli(arith.subi(e, _i32(10)), _i32(23)))
        def store(pos0, vals, ok):
            f16 = [arith.truncf(ir.F16Type.get(), arith.mulf(v, up)) for v in vals]
            packed = vector.from_elements(ir.VectorType.get((per,), ir.F16Type.get()), f16)
            if tile:
                at = _tile_offset(args[-2].registers.item(),
                                  arith.subi(pos0, args[-1].registers.item()),
                                  wn=tile[3], bk=tile[4])
            else:
                at = arith.muli(arith.addi(arith.muli(row, _i32(kcols)), pos0), _i32(2))
            if ok is None:
                llvm.store(packed, _gep(h_ptr, at))
            else:
                with mgpu.utils.when(ok):
                    llvm.store(packed, _gep(h_ptr, at))

        with mgpu.utils.when(arith.cmpi(arith.CmpIPredicate.ult, r, count_.registers.item())):
            if keep:
                for chunk in kept:
                    store(*chunk)
            else:
                @mgpu.utils.fori(_i32(rolls), ())
                def _(i, carry):
                    for j in range(H_ROLL):
                        store(*h_values(arith.addi(arith.muli(i, _i32(H_ROLL)), _i32(j))))
                    return carry
            with mgpu.utils.when(arith.cmpi(arith.CmpIPredicate.eq, lane, _i32(0))):
                slot = args[-2].registers.item() if tile else row
                llvm.store(down, _gep(hf_ptr, arith.muli(slot, _i32(4))))
        mgpu.utils.warpgroup_barrier()  # every thread's stores before the caller's release

    program(*refs, jnp.asarray(first, jnp.int32), jnp.asarray(count, jnp.int32),
            *((jnp.asarray(tile[0], jnp.int32), jnp.asarray(tile[1], jnp.int32)) if tile
              else ()))


def _tile_offset(slot, local, *, wn: int, bk: int):
    """Byte offset (i32) of element ``(local // bk, slot, local % bk)`` of an SMEM tile ``[S,
    wn, bk]`` f16 in the wgmma B operand's layout: each step's ``[wn, bk]`` block in tiles of 8
    rows x 64 columns (row tile, then column tile), a tile's 128-byte row ``r % 8`` with its
    16-byte chunks XOR-ed with ``r % 8``."""
    step, within = arith.divui(local, _i32(bk)), arith.remui(local, _i32(bk))
    t = arith.addi(arith.muli(arith.remui(slot, _i32(8)), _i32(128)),
                   arith.muli(arith.remui(within, _i32(64)), _i32(2)))
    t = arith.xori(t, arith.shli(arith.remui(slot, _i32(8)), _i32(4)))
    base = functools.reduce(arith.addi, [
        arith.muli(step, _i32(wn * bk * 2)), arith.muli(arith.divui(slot, _i32(8)),
                                                        _i32(8 * bk * 2)),
        arith.muli(arith.divui(within, _i32(64)), _i32(1024))])
    return arith.addi(base, t)


def _proxy_fence():
    """``fence.proxy.async.global`` then a warpgroup barrier: the generic and the async (TMA)
    proxy agree on global memory, for every thread, before a release or after an acquire."""

    @plgpu.inline_mgpu()
    def fence(_):
        mgpu.utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)
        mgpu.utils.warpgroup_barrier()

    fence()


# slot_mlp(timeline=True)'s columns: phase 0 gate_up, 1 h, 2 down; item: the work item
TIMELINE_COLUMNS = ("start", "waited", "end", "sm", "phase", "item")


def _stamp(timeline_ref, pid, column: int, phase=None, item=None):
    """One thread of the program stores the low 32 bits of ``%globaltimer`` (ns) at
    ``timeline_ref[pid, column]``; the end (column 2) also stores the SM's id, the program's
    ``phase`` and ``item``."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) + (plgpu.Layout.WG_SPLAT,) * 3)
    def stamp(_, ref, program, phase_, item_):
        i32 = ir.IntegerType.get_signless(32)
        ptr = mgpu.utils.memref_ptr(ref)
        row = arith.muli(program.registers.item(), _i32(4 * len(TIMELINE_COLUMNS)))

        def store(value, col):
            llvm.store(value, _gep(ptr, arith.addi(row, _i32(4 * col))))

        with mgpu.utils.single_thread(scope=mgpu.ThreadSubset.WARPGROUP):
            store(mgpu.utils.inline_ptx("mov.u32 $0, %globaltimer_lo;", result_types=i32,
                                        has_side_effects=True), column)
            if column == 2:
                store(mgpu.utils.inline_ptx("mov.u32 $0, %smid;", result_types=i32), 3)
                store(phase_.registers.item(), 4)
                store(item_.registers.item(), 5)

    tags = (0, 0) if phase is None else (phase, item)
    stamp(timeline_ref, *(jnp.asarray(v, jnp.int32) for v in (pid, *tags)))


def _fused_programs(two_i: int, hidden: int, k_splits: tuple[int, int],
                    rows: int) -> tuple[int, int, int]:
    """An item (of at most ``rows`` rows)'s programs in each phase of ``slot_mlp``'s grid:
    (gate_up, h, down)."""
    return (two_i // BLOCK_N * k_splits[0], -(-rows // H_PROGRAM_ROWS),
            hidden // BLOCK_N * k_splits[1])


def _fused_kernel(work_gmem, a_gmem, a_factor, *rest, num_stacks: int, fmt: str,
                  gate_up_bias: bool, down_bias: bool, sync: bool, timeline: bool, gate_up: dict,
                  down: dict, h_program: dict):
    """``slot_mlp``'s launch (see the comment above). ``rest``: the gate_up stacks, the down
    stacks (``_kernel``'s), [gate_up bias], [down bias]; out gu [S_gu * R, 2I] f32, h [R, I]
    f16, h factor [R] f32, y [S_down * R, H] f32, [timeline [programs, 6] i32]; [w stages
    (interpret: gate_up's, down's)]."""
    gu_stacks, rest = _split_stacks(rest, fmt, num_stacks)
    down_stacks, rest = _split_stacks(rest, fmt, num_stacks)
    gu_bias = rest.pop(0) if gate_up_bias else None
    dn_bias = rest.pop(0) if down_bias else None
    gu_o, h_o, hf_o, y_o, *rest = rest
    tl_o = rest.pop(0) if timeline else None
    stages = rest or (None, None)
    w = work_gmem.shape[1]
    nt_gu, nt_down = gu_o.shape[1] // BLOCK_N, y_o.shape[1] // BLOCK_N
    gu_per_item, h_parts, down_per_item = _fused_programs(
        gu_o.shape[1], y_o.shape[1], (gate_up["k_splits"], down["k_splits"]),
        gate_up["tile"].rows)
    n_gu = w * gu_per_item
    # [2, W], shared by every program (a scratch semaphore would be a program's own), zero-filled
    # before each launch (Pallas' GMEM scratch; the counts are not taken back)
    sems = pl.get_global(plgpu.SemaphoreType.REGULAR((2, w))) if sync else None
    pid = lax.axis_index("p")
    if timeline:  # "waited" is the start for programs that do not wait
        _stamp(tl_o, pid, 0)
        _stamp(tl_o, pid, 1)

    def tile_split(q, tiles, splits):
        """An item's program ``q`` of a phase -> (tile, split)."""
        return lax.rem(q, tiles), lax.div(q, tiles) if splits > 1 else None

    @pl.when(pid < n_gu)
    def _():
        u = lax.div(pid, gu_per_item)  # an item's programs one after another
        nt, split = tile_split(lax.rem(pid, gu_per_item), nt_gu, gate_up["k_splits"])
        _matmul_program(work_gmem, a_gmem, gu_stacks, a_factor, gu_bias, gu_o,
                        stages[0], u=u, nt=nt, split=split, fmt=fmt, **gate_up)
        if sync:
            @pl.when(work_gmem[2, u] > 0)
            def _():
                _proxy_fence()  # the TMA stores completed (wait_smem_to_gmem(0)): visible
                plgpu.semaphore_signal(sems.at[0, u], 1, memory_scope="gpu")

    q = pid - n_gu  # then the h and down programs: (item, h part or down program)
    is_h, d = q < h_parts * w, q - h_parts * w  # all h programs, then all down programs
    u = jnp.where(is_h, lax.div(q, h_parts), lax.div(d, down_per_item))
    part, d = lax.rem(q, h_parts), lax.rem(d, down_per_item)

    @pl.when((pid >= n_gu) & is_h)
    def _():
        first = work_gmem[1, u] + part * H_PROGRAM_ROWS
        count = jnp.minimum(jnp.maximum(work_gmem[2, u] - part * H_PROGRAM_ROWS, 0),
                            H_PROGRAM_ROWS)

        @pl.when(count > 0)
        def _():
            if not sync:
                _h_program_jnp(gu_o, h_o, hf_o, first, count, **h_program)
                return
            if FUSED_WAIT:
                plgpu.semaphore_wait(sems.at[0, u], gu_per_item, decrement=False,
                                     memory_scope="gpu")
            _proxy_fence()
            if timeline:
                _stamp(tl_o, pid, 1)
            if H_PROGRAM_ROWS >= 4:  # a row within a warp: shuffles only
                _h_program_inline(gu_o, h_o, hf_o, first, count, **h_program)
            else:
                pl.run_scoped(lambda red: _h_program_inline(gu_o, h_o, hf_o, first, count, red,
                                                            **h_program),
                              plgpu.SMEM((4,), jnp.float32))

        if sync:  # every part of a used item, rows or not
            @pl.when(work_gmem[2, u] > 0)
            def _():
                plgpu.semaphore_signal(sems.at[1, u], 1, memory_scope="gpu")

    @pl.when((pid >= n_gu) & ~is_h)
    def _():
        nt, split = tile_split(d, nt_down, down["k_splits"])
        if sync:
            @pl.when(work_gmem[2, u] > 0)
            def _():
                if FUSED_WAIT:
                    plgpu.semaphore_wait(sems.at[1, u], h_parts, decrement=False,
                                         memory_scope="gpu")
                _proxy_fence()  # h's generic stores before the TMA loads
                if timeline:
                    _stamp(tl_o, pid, 1)

        _matmul_program(work_gmem, h_o, down_stacks, hf_o, dn_bias, y_o,
                        stages[1], u=u, nt=nt, split=split, fmt=fmt, **down)

    if timeline:
        phase = jnp.where(pid < n_gu, 0, jnp.where(is_h, 1, 2))
        _stamp(tl_o, pid, 2, phase, jnp.where(pid < n_gu, lax.div(pid, gu_per_item), u))


_MLP_STATIC = ("fmt", "fp8_block", "tiles", "k_splits", "activation", "layout", "limit",
               "alpha", "timeline", "interpret")


@functools.partial(jax.jit, static_argnames=_MLP_STATIC)
def slot_mlp(
    work: jax.Array,  # [3, W] int32 (slot_matmul's)
    a: jax.Array,  # [R, H] f16: x's rows scaled (rows.x_rows; FP4: gate_up's operand order)
    a_factor: jax.Array,  # [R] f32
    gate_up: jax.Array,  # [E, 2I, H] e4m3 | FP4 codes [E, 2I, H/2] u8
    down: jax.Array,  # [E, H, I] likewise
    gate_up_scale: jax.Array | None = None,  # slot_matmul's scale of each
    down_scale: jax.Array | None = None,
    gate_up_global_scale: jax.Array | None = None,  # NVFP4
    down_global_scale: jax.Array | None = None,
    *,
    extra_gate_up: tuple | None = None,  # (w, scale, global_scale) of a second stack
    extra_down: tuple | None = None,
    gate_up_bias: jax.Array | None = None,  # [E, 2I] (the main stack's)
    down_bias: jax.Array | None = None,  # [E, H]
    fmt: str | None = None,
    fp8_block: tuple[int, int] | None = None,
    tiles: tuple[SlotTile, SlotTile] = (SlotTile(), SlotTile()),  # (gate_up, down)
    k_splits: tuple[int, int] = (1, 1),
    activation: Activation = Activation.SILU,
    layout: GateUpLayout = GateUpLayout.CONCATENATED,
    limit: float | None = None,
    alpha: float = GPT_OSS_ALPHA,
    timeline: bool = False,
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``slot_matmul`` (gate_up, x's factors and bias in its epilogue) -> ``rows.h_rows`` ->
    ``slot_matmul`` (down) in one launch: ``[k_splits[1] * R, H]`` f32, the down launch's
    stacked output (rows no item owns: not written). f16 activations only (FP8, NVFP4,
    MXFP4). ``timeline=True`` (compiled only; a profiling aid) also returns ``[programs, 6]``
    int32, each program's ``TIMELINE_COLUMNS``: the low 32 bits of ``%globaltimer`` (ns) at
    its start, after its wait (its start if it has none) and at its end, its SM, its phase
    (0 gate_up, 1 h, 2 down) and its work item."""
    if a.ndim != 2 or work.ndim != 2 or work.shape[0] != 3:
        raise ValueError(f"a, work: expected [R, H] and [3, W], got {a.shape}, {work.shape}")
    activation, layout = Activation.coerce(activation), GateUpLayout.coerce(layout)
    if activation is Activation.GPT_OSS and limit is None:
        limit = GPT_OSS_LIMIT
    rows = a.shape[0]
    gu_fmt, two_i, hidden, gu_global_rows, gu_ops, gu_pad = _stack_operands(
        gate_up, gate_up_scale, gate_up_global_scale, extra_gate_up, fmt=fmt,
        fp8_block=fp8_block, tile=tiles[0], k_splits=k_splits[0], interpret=interpret)
    fmt, n_down, inter, down_global_rows, down_ops, _ = _stack_operands(
        down, down_scale, down_global_scale, extra_down, fmt=gu_fmt, fp8_block=fp8_block,
        tile=tiles[1], k_splits=k_splits[1], interpret=interpret)
    if activation_dtype(fmt) != jnp.float16:
        raise NotImplementedError(f"slot_mlp: f16 activations (FP8, NVFP4, MXFP4), not {fmt}")
    if timeline and interpret:
        raise ValueError("timeline: the compiled kernel's clock; interpret mode has none")
    if (extra_gate_up is None) != (extra_down is None):
        raise ValueError("extra_gate_up, extra_down: both or neither")
    if two_i != 2 * inter or n_down != hidden:
        raise ValueError(f"down: expected [E, {hidden}, {two_i // 2}] (logical), got "
                         f"[E, {n_down}, {inter}]")
    _item_rows(tiles, "tiles")
    fp4 = fmt in _WIDE_FORMATS  # its rows in the operand order, padded to whole K steps
    width = row_launches.row_width(hidden, tiles[0].block_k if fp4 else None)
    if a.shape != (rows, width) or a.dtype != jnp.float16 or rows < tiles[0].window:
        raise ValueError(f"a: expected [R >= {tiles[0].window}, {width}] float16, got {a.shape} "
                         f"{a.dtype}")
    if a_factor.shape != (rows,) or a_factor.dtype != jnp.float32:
        raise ValueError(f"a_factor: expected [{rows}] float32, got {a_factor.shape} "
                         f"{a_factor.dtype}")
    biases = []
    for name, b, n in (("gate_up_bias", gate_up_bias, two_i), ("down_bias", down_bias, hidden)):
        if b is not None:
            if extra_gate_up is not None:
                raise ValueError(f"{name}: the extra stack takes no biases")
            biases.append(_checked_bias(b, gate_up.shape[0], n))
    # h's columns padded to whole K steps: FP4 (the operand order over a ragged K), interpret
    #   mode (the TMA's zero fill past K)
    h_cols = num_k_steps(inter, tiles[1]) * tiles[1].block_k if interpret or fp4 else inter
    splits_gu, splits_down = k_splits
    programs = work.shape[1] * sum(_fused_programs(two_i, hidden, k_splits, tiles[0].rows))
    scratch = [_w_stage(t, jnp.float16) for t in tiles] if interpret else []
    kernel = plgpu.kernel(
        functools.partial(
            _fused_kernel, num_stacks=1 + (extra_gate_up is not None), fmt=fmt,
            gate_up_bias=gate_up_bias is not None, down_bias=down_bias is not None,
            sync=not interpret, timeline=timeline,
            gate_up=dict(fp8_block=fp8_block, tile=tiles[0], global_rows=gu_global_rows or 0,
                         k=hidden, k_splits=splits_gu),
            down=dict(fp8_block=fp8_block, tile=tiles[1], global_rows=down_global_rows or 0,
                      k=inter, k_splits=splits_down),
            h_program=dict(splits=splits_gu, rows=rows, layout=layout, activation=activation,
                           limit=limit, alpha=alpha,
                           block_k=tiles[1].block_k if fp4 else None)),
        out_type=(jax.ShapeDtypeStruct((splits_gu * rows, two_i), jnp.float32),
                  jax.ShapeDtypeStruct((rows, h_cols), jnp.float16),
                  jax.ShapeDtypeStruct((rows,), jnp.float32),
                  jax.ShapeDtypeStruct((splits_down * rows, hidden), jnp.float32))
        + ((jax.ShapeDtypeStruct((programs, len(TIMELINE_COLUMNS)), jnp.int32),) if timeline
           else ()),
        grid=(programs,),
        grid_names=("p",),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    _, _, _, y, *tl = kernel(work, a if fp4 else gu_pad(a), a_factor, *gu_ops, *down_ops,
                             *biases)
    return (y, tl[0]) if timeline else y


# ---------------------------------------------------------------------------------------------
# The full decode step: chunked plan, two launches, XLA glue.
# ---------------------------------------------------------------------------------------------


def work_items(plan: DecodePlan, num_experts: int, item_rows: int = ROWS) -> jax.Array:
    """``[3, W]`` int32 (expert, first sorted row, row count): the decode plan's slots cut into
    items of at most ``item_rows`` rows (``kernel.cut_base``), on device; items past the last
    are ``(num_experts, routed rows, 0)``. ``W = kernel.num_items(U, P, item_rows)`` bounds
    their number. The plan's own ``items`` where the Pallas plan launch cut them
    (``make_plan(item_rows=)``, the same ``item_rows``), else XLA (a cumsum)."""
    if plan.items is not None:
        return plan.items
    expert, first, rows = plan.work  # [U]
    u_slots = expert.shape[0]
    items = num_items(u_slots, plan.token_of_row.shape[0], item_rows)
    chunks = item_count(first, rows, item_rows)  # [U]
    ends = jnp.cumsum(chunks)  # [U] inclusive
    w = jnp.arange(items, dtype=jnp.int32)
    slot = jnp.sum((ends[None, :] <= w[:, None]).astype(jnp.int32), axis=1)  # [W]
    slot_c = jnp.minimum(slot, u_slots - 1)
    c = w - (ends[slot_c] - chunks[slot_c])  # chunk within its slot
    used = slot < u_slots
    start, end = item_span(first[slot_c], rows[slot_c], c, item_rows)
    return jnp.stack([jnp.where(used, expert[slot_c], num_experts),
                      jnp.where(used, start, jnp.sum(rows)),
                      jnp.where(used, end - start, 0)]).astype(jnp.int32)


_MOSAIC_STATIC = ("fmt", "activation", "gate_up_layout", "limit", "alpha", "block_size", "tile",
                  "k_splits", "fused", "timeline", "interpret")
_FMT_NAMES = {WeightFormat.BF16: "bf16", WeightFormat.FP8_BLOCK: "fp8",
              WeightFormat.NVFP4: "nvfp4", WeightFormat.MXFP4: "mxfp4"}


def format_name(fmt: WeightFormat | str | None, w_dtype) -> str:
    """The kernels' name (``FORMATS``) for ``fmt``, or from the weight dtype where ``fmt`` is
    None (e4m3: fp8; bf16: bf16; uint8 codes are NVFP4 or MXFP4: ``fmt`` must say). A name
    from ``FORMATS`` passes through."""
    if fmt in FORMATS:
        return fmt
    if fmt is not None:
        return _FMT_NAMES[WeightFormat.coerce(fmt)]
    w_dtype = jnp.dtype(w_dtype)
    if w_dtype == jnp.float8_e4m3fn:
        return "fp8"
    if w_dtype == jnp.bfloat16:
        return "bf16"
    raise ValueError(f"fmt: {w_dtype} weights need fmt='nvfp4' or 'mxfp4' (or are not "
                     f"supported: bf16, e4m3 and FP4 codes are)")


@functools.partial(jax.jit, static_argnames=_MOSAIC_STATIC)
def moe_decode_mosaic_pairs(
    x: jax.Array,  # [T, H] bf16
    expert_ids: jax.Array,  # [T, k] int; outside [0, E): zero expert (skipped)
    gate_up: jax.Array,  # [E, 2I, H] e4m3 | bf16, or [E, 2I, H/2] u8 (FP4)
    down: jax.Array,  # [E, H, I] e4m3 | bf16, or [E, H, I/2] u8 (FP4)
    *,
    fmt: WeightFormat | str | None = None,  # None: from the weight dtype (e4m3, 16-bit)
    gate_up_scale: jax.Array | None = None,  # FP8 scale_inv | NVFP4 e4m3 | MXFP4 u8 (E8M0)
    gate_up_global_scale: jax.Array | None = None,  # NVFP4 [E, R] or [E] f32
    down_scale: jax.Array | None = None,
    down_global_scale: jax.Array | None = None,
    gate_up_bias: jax.Array | None = None,  # [E, 2I]
    down_bias: jax.Array | None = None,  # [E, H]
    activation: Activation | str = Activation.SILU,
    gate_up_layout: GateUpLayout | str = GateUpLayout.CONCATENATED,
    limit: float | None = None,
    alpha: float = GPT_OSS_ALPHA,
    block_size: tuple[int, int] = (128, 128),
    tile: tuple[SlotTile, SlotTile] | None = None,  # (gate_up, down); None: choose_slot_tile
    k_splits: tuple[int, int] | str = "auto",  # (gate_up, down) K splits; "auto":
    #   choose_k_splits
    fused: bool | None = None,  # gate_up, h and down in one launch (slot_mlp; f16
    #   activations); None: for f16 activations at FUSE_MLP_TOKENS tokens (from one fewer
    #   where the down programs have no own h)
    timeline: bool = False,  # the one launch only: also its programs' clock stamps (slot_mlp)
    interpret: bool = False,
    extra: ExtraExperts | None = None,  # a second stack: expert ids E .. E + E2 - 1
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Routed expert outputs of each (token, slot) pair ``[T, k, H]`` f32 (zero experts: 0),
    as ``kernel.moe_decode_pairs``, through the Mosaic GPU launches (module docstring); h
    between them is rounded to bf16 as there. ``extra`` (the shared expert folded in): same
    format and per-expert shapes, no biases. ``tile`` (``SlotTile`` of each launch: K step,
    stages) and ``k_splits`` (``slot_matmul``'s, per launch; "auto": ``choose_k_splits``)
    default to the settings timed on the H200. ``timeline=True`` (with the one launch, compiled;
    a profiling aid) returns ``(pairs, slot_mlp's timeline)``."""
    activation = Activation.coerce(activation)
    layout = GateUpLayout.coerce(gate_up_layout)
    if activation is Activation.GPT_OSS and limit is None:
        limit = GPT_OSS_LIMIT
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        raise NotImplementedError(f"x: the Mosaic decode path takes bf16 [T, H], got "
                                  f"{x.dtype} {x.shape}")
    fmt = format_name(fmt, gate_up.dtype)
    packed = 2 if fmt in ("nvfp4", "mxfp4") else 1  # codes a byte
    e, two_i, hidden = gate_up.shape
    hidden *= packed
    inter = two_i // 2
    if down.shape != (e, hidden, inter // packed):
        raise ValueError(f"down: expected shape {(e, hidden, inter // packed)}, got "
                         f"{down.shape}")
    fp8_block = tuple(block_size) if fmt == "fp8" else None
    if fused and fmt == "bf16":
        raise NotImplementedError("fused: one launch takes f16 activations (FP8, NVFP4, MXFP4), "
                                  "not BF16 weights")
    e_all = e
    if extra is not None:
        if not isinstance(extra, ExtraExperts):
            raise TypeError(f"extra: expected ExtraExperts, got {type(extra).__name__}")
        if gate_up_bias is not None or down_bias is not None:
            raise ValueError("extra: the main stack has biases (the extra stack has none)")
        if extra.gate_up_bias is not None or extra.down_bias is not None:
            raise ValueError("extra: biases are not supported")
        e_all += extra.gate_up.shape[0]
    p = expert_ids.size
    if tile is None:
        item_rows = choose_item_rows(x.shape[0], fmt, density=p / e_all)
        tile = (choose_slot_tile(hidden, fmt=fmt, rows=item_rows),
                choose_slot_tile(inter, fmt=fmt, rows=item_rows))
    item_rows = _item_rows(tile, "tile")
    rows = window_rows(p, item_rows)  # sorted rows, then rows no item owns (in the last windows)

    def order(t):  # FP4: the activations in the operand column order of t's K steps
        return t.block_k if packed == 2 else None

    x16 = None  # x's f16 rows (f16 activations), where the plan's launch makes them
    blocked = blocked_items(x.shape[0], fmt, p / e_all) and item_rows == 8
    if blocked:  # kernel.blocked_plan
        plan = make_plan(expert_ids, e_all, pallas=not interpret, interpret=interpret,
                         blocked=True)
        rows = plan.token_of_row.shape[0]
    elif fmt != "bf16" and p <= row_launches.PLAN_X_ROWS_MAX_PAIRS:
        plan, x16 = plan_x_rows(x, expert_ids, e_all, rows, item_rows=item_rows,
                                block_k=order(tile[0]), interpret=interpret)
    else:
        plan = make_plan(expert_ids, e_all, pallas=not interpret, interpret=interpret,
                         item_rows=item_rows)
    work = work_items(plan, e_all, item_rows)
    if k_splits == "auto":
        items = min(e_all, expert_ids.size)
        sms = device_sm_count() or 132  # interpret mode: as on the H200
        k_splits = (choose_k_splits(items, two_i, hidden, tile[0], sms=sms),
                    choose_k_splits(items, hidden, inter, tile[1], sms=sms))
    elif not (isinstance(k_splits, tuple) and len(k_splits) == 2):
        raise ValueError(f"k_splits: expected (gate_up, down) ints or 'auto', got {k_splits!r}")
    own_h = down_makes_h(x.shape[0], fmt, inter, tile[1], k_splits[1])
    if fused is None:  # FUSE_MLP_TOKENS, from one token fewer where the down has no own h
        lo = FUSE_MLP_TOKENS[0] - (not own_h)
        fused = fmt != "bf16" and lo <= x.shape[0] <= FUSE_MLP_TOKENS[1]
    if timeline and not fused:
        raise ValueError("timeline: stamps come from the one launch (fused=True)")

    def bias_operand(b):  # as given where the kernels read its dtype, else f32
        return b if b is None or jnp.dtype(b.dtype) in _BIAS_TYPES else b.astype(jnp.float32)

    gate_up_bias, down_bias = bias_operand(gate_up_bias), bias_operand(down_bias)

    def launch(a, factor, w, scale, global_scale, bias, extra_stack, tile, splits):
        """``a [R, K]`` (sorted rows, times ``factor`` back) through one launch, the bias
        added: ``[splits * R, N]`` f32, the K-split partials stacked (rows past the items'
        hold garbage: they only meet other garbage rows)."""
        return slot_matmul(work, a, w, scale, extra_stack, global_scale, row_factor=factor,
                           bias=bias, fmt=fmt, fp8_block=fp8_block, tile=tile, k_splits=splits,
                           sum_splits=False, interpret=interpret)

    xs = None if extra is None else (extra.gate_up, extra.gate_up_scale,
                                     extra.gate_up_global_scale)
    xd = None if extra is None else (extra.down, extra.down_scale, extra.down_global_scale)
    if fmt == "bf16":  # bf16 rows, the glue in XLA
        token = jnp.pad(plan.token_of_row, (0, rows - p))  # [R] (extra rows: token 0)
        gu = launch(x[token], None, gate_up, gate_up_scale, gate_up_global_scale, gate_up_bias,
                    xs, tile[0], k_splits[0]).reshape(k_splits[0], rows, two_i).sum(axis=0)
        gate, up = split_gate_up(gu, layout)
        # h as the Triton path stores it (bf16); the barrier keeps the rounding under XLA's
        # GPU excess-precision rule (grouped_matmul.reference.rounded)
        h = rounded(_epilogue(gate, up, activation, limit, alpha), jnp.bfloat16)  # [R, I]
        h, factor = h.astype(jnp.bfloat16), None
    else:  # f16 rows scaled per row (rows.py: one launch each)
        a, factor = x16 or x_rows(x, plan.token_of_row, rows, block_k=order(tile[0]),
                                  padding=blocked, interpret=interpret)
        if fused:  # gate_up, h and down in one launch
            y = slot_mlp(work, a, factor, gate_up, down, gate_up_scale, down_scale,
                         gate_up_global_scale, down_global_scale, extra_gate_up=xs,
                         extra_down=xd, gate_up_bias=gate_up_bias, down_bias=down_bias,
                         fmt=fmt, fp8_block=fp8_block, tiles=tuple(tile),
                         k_splits=tuple(k_splits), activation=activation, layout=layout,
                         limit=limit, alpha=alpha, timeline=timeline, interpret=interpret)
            y, stamps = y if timeline else (y, None)
            pairs = pairs_of(y.reshape(k_splits[1], rows, hidden), plan)
            return (pairs, stamps) if timeline else pairs
        gu = launch(a, factor, gate_up, gate_up_scale, gate_up_global_scale, gate_up_bias, xs,
                    tile[0], k_splits[0])  # [S * R, 2I]
        if own_h:  # each down program its own h
            y = slot_matmul(work, gu, down, down_scale, xd, down_global_scale, bias=down_bias,
                            fmt=fmt, fp8_block=fp8_block, tile=tile[1], k_splits=k_splits[1],
                            sum_splits=False, interpret=interpret, h_source=HSource(
                                k_splits[0], activation, layout, limit, alpha))
            return pairs_of(y.reshape(k_splits[1], rows, hidden), plan)
        h, factor = h_rows(gu, splits=k_splits[0], activation=activation, layout=layout,
                           limit=limit, alpha=alpha, block_k=order(tile[1]),
                           interpret=interpret)
    y = launch(h, factor, down, down_scale, down_global_scale, down_bias, xd, tile[1],
               k_splits[1]).reshape(k_splits[1], rows, hidden)  # [S, R, H]
    return pairs_of(y, plan)

