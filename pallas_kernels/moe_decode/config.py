"""Static configuration of the MoE decode kernels: the per-kernel tile, the pair of tiles, and
the heuristic that picks them.

Everything here is hashable and validated at construction, so it can be a static argument of
``jax.jit``. The weight-format, activation and layout enums are the grouped matmul's
(``pallas_kernels.grouped_matmul.config``); nothing here imports ``atlas_jax``.
"""

from __future__ import annotations

import dataclasses
import math

from pallas_kernels.grouped_matmul.config import (
    FP8_ACT_GROUP,
    MXFP4_GROUP,
    NVFP4_GROUP,
    ActivationQuant,
    WeightFormat,
    _shared_memory_budget,
)

MIN_DOT = 16  # smallest tl.dot extent along M, N and K
FEW_TOKENS = 3  # decode steps of up to this many tokens (1, MTP verify 2-3): block_n >= 64
F16_DOT_FORMATS = (WeightFormat.FP8_BLOCK, WeightFormat.NVFP4, WeightFormat.MXFP4)  # f16 route
FP4_FORMATS = (WeightFormat.NVFP4, WeightFormat.MXFP4)
# One token, FP4 weights, on a GPU, fewer gate_up programs than SMs: the gate_up launch splits
# K this many ways (its partials summed and activated by one small XLA fusion). Its unsplit
# programs are too few to hide the per-step unpack (Qwen3-30B-A3B: 8 experts x 12 column
# tiles = 96 on the H200's 132 SMs; gpt-oss-120b's 4 x 45 and DeepSeek-V3's 8 x 32 are not
# split: unmeasured).
# Measured on the H200 (kernels alone, Qwen3-30B-A3B): NVFP4 41.0 -> 36.8 us, MXFP4 45.0 ->
# 36.2 us; FP8 and BF16 gained nothing, nor did 3 tokens beyond the run-to-run spread.
ONE_TOKEN_FP4_GATE_UP_SPLIT = 4
# The same rule for W8A8 gate_up (FP8 weights, e4m3 activations), 2 ways. Measured on the H200
# (Qwen3-30B-A3B, 1 token): full step 41.1 -> 33.3 us; the sweep that chose x2 (kernels alone,
# an earlier build quantizing in the kernels): 36.2 -> 32.5 us at x2, 38.2 at x4.
ONE_TOKEN_W8A8_GATE_UP_SPLIT = 2


def _is_pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


def _next_pow2(v: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(v, 1))))


@dataclasses.dataclass(frozen=True)
class DecodeTile:
    """Tile of one decode kernel (gate_up or down).

    A program owns one selected expert and ``block_n`` output columns (per half: the gate_up
    kernel holds a gate and an up accumulator). It walks the expert's rows (the (token, slot)
    pairs routed to it) ``block_m`` at a time -- one chunk for up to ``block_m`` rows, the usual
    decode case, so the expert's weight tile is read once -- and K ``block_k`` per loop step.
    """

    block_n: int  # output columns per program (per half for gate_up)
    block_k: int  # K per loop step (FP8: divides the scale block along K)
    block_m: int = 16  # rows per dot (a program loops over cdiv(rows, block_m) chunks)
    num_warps: int = 4
    num_stages: int = 3  # software-pipelining depth of the K loop
    # Weight tile as the MMA's M operand: dot(w [bn, bk], a^T [bk, bm]) (decode rows are few).
    swap_ab: bool = True
    # FP8_BLOCK / NVFP4 / MXFP4 only: f16 dot operands. e4m3 -> f16 is one cvt per two values
    # on sm_90 (bf16 needs two more); FP4 codes become f16 by bit placement (e2m1 * 2^-14). The
    # activation rows are scaled by a power of two into f16 range and the f32 accumulator
    # scaled back: exact up to f16 subnormals (see kernel.py; MXFP4: also its scale spread).
    f16_dot: bool = False
    # Split-K: the K loop is cut into ``split_k`` ranges, one program each (grid axis 2), for
    # steps with too few (expert, N tile) programs to fill the GPU (1..3 tokens). Partials are
    # f32 and summed after the launch, without atomics: down's in the combine; gate_up's
    # (gate and up pre-activations) by one small XLA fusion that activates them into h.
    split_k: int = 1

    def __post_init__(self):
        for name, lo, hi in (("block_n", MIN_DOT, 512), ("block_k", MIN_DOT, 512),
                             ("block_m", MIN_DOT, 128)):
            v = getattr(self, name)
            if not _is_pow2(v) or not lo <= v <= hi:
                raise ValueError(
                    f"DecodeTile.{name}: expected a power of two in [{lo}, {hi}], got {v!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"DecodeTile.num_warps: expected one of 1, 2, 4, 8, 16, got {self.num_warps!r}")
        if (not isinstance(self.num_stages, int) or isinstance(self.num_stages, bool)
                or not 1 <= self.num_stages <= 8):
            raise ValueError(
                f"DecodeTile.num_stages: expected an int in [1, 8], got {self.num_stages!r}")
        if (not isinstance(self.split_k, int) or isinstance(self.split_k, bool)
                or not 1 <= self.split_k <= 32):
            raise ValueError(
                f"DecodeTile.split_k: expected an int in [1, 32], got {self.split_k!r}")
        for name in ("swap_ab", "f16_dot"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"DecodeTile.{name}: expected a bool, got "
                                 f"{getattr(self, name)!r}")

    def check_format(self, fmt: WeightFormat, *, fp8_block: tuple[int, int] = (128, 128),
                     act_quant: ActivationQuant = ActivationQuant.NONE):
        """Raises ValueError when this tile cannot run weights of format ``fmt`` (with
        activations quantized by ``act_quant``)."""
        fmt = WeightFormat.coerce(fmt)
        act_quant = ActivationQuant.coerce(act_quant)
        bk = self.block_k
        match fmt:
            case WeightFormat.FP8_BLOCK:
                if fp8_block[1] % bk:
                    raise ValueError(
                        f"DecodeTile.block_k: FP8_BLOCK needs block_k to divide the scale "
                        f"block along K ({fp8_block[1]}), got {bk}")
            case WeightFormat.NVFP4 | WeightFormat.MXFP4:
                group = NVFP4_GROUP if fmt is WeightFormat.NVFP4 else MXFP4_GROUP
                # FP4 tiles are split into even / odd K columns, each >= 16 wide for tl.dot.
                if bk % group or bk < 2 * MIN_DOT:
                    raise ValueError(
                        f"DecodeTile.block_k: {fmt.value} needs a multiple of {group} and "
                        f">= {2 * MIN_DOT}, got {bk}")
            case WeightFormat.BF16:
                pass
        if self.f16_dot and fmt not in F16_DOT_FORMATS:
            raise ValueError(
                f"DecodeTile.f16_dot: only for {', '.join(f.value for f in F16_DOT_FORMATS)} "
                f"weights, got {fmt.value}")
        if act_quant is ActivationQuant.FP8:
            if fmt is not WeightFormat.FP8_BLOCK:
                raise ValueError(f"W8A8 (act_quant fp8) needs FP8_BLOCK weights, got {fmt.value}")
            if FP8_ACT_GROUP % bk or bk < 2 * MIN_DOT:
                raise ValueError(
                    f"DecodeTile.block_k: W8A8 needs block_k in [{2 * MIN_DOT}, "
                    f"{FP8_ACT_GROUP}] dividing {FP8_ACT_GROUP} (fp8 dots take K >= 32), got "
                    f"{bk}")
            if self.f16_dot:
                raise ValueError("DecodeTile.f16_dot: W8A8 dots take e4m3 operands, not f16")
        elif act_quant is not ActivationQuant.NONE:
            raise ValueError(f"act_quant: the decode kernels take none or fp8, got "
                             f"{act_quant.value}")


@dataclasses.dataclass(frozen=True)
class MoEDecodeConfig:
    """The tiles of the two decode kernels."""

    gate_up: DecodeTile  # block_n counts columns of I (the program holds gate and up)
    down: DecodeTile  # block_n counts columns of H

    def __post_init__(self):
        for name in ("gate_up", "down"):
            if not isinstance(getattr(self, name), DecodeTile):
                raise ValueError(f"MoEDecodeConfig.{name}: expected a DecodeTile, got "
                                 f"{getattr(self, name)!r}")

    def check_format(self, fmt: WeightFormat, *, fp8_block: tuple[int, int] = (128, 128),
                     gate_up_act_quant: ActivationQuant = ActivationQuant.NONE,
                     down_act_quant: ActivationQuant = ActivationQuant.NONE):
        self.gate_up.check_format(fmt, fp8_block=fp8_block, act_quant=gate_up_act_quant)
        self.down.check_format(fmt, fp8_block=fp8_block, act_quant=down_act_quant)


def expected_distinct_experts(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Distinct experts of ``num_tokens`` tokens under uniform top-k routing (rounded)."""
    bound = min(num_experts, num_tokens * top_k)
    p_unused = (1.0 - min(top_k, num_experts) / num_experts) ** num_tokens
    return max(1, min(bound, round(num_experts * (1.0 - p_unused))))


_WEIGHT_BYTES = {
    WeightFormat.BF16: 2.0,
    WeightFormat.FP8_BLOCK: 1.0,
    WeightFormat.NVFP4: 0.5 + 1 / NVFP4_GROUP,
    WeightFormat.MXFP4: 0.5 + 1 / MXFP4_GROUP,
}


def choose_tile(
    n: int,
    k: int,
    fmt: WeightFormat,
    *,
    halves: int,
    num_programs_per_column: int,
    fp8_block: tuple[int, int] = (128, 128),
    x_itemsize: int = 2,
    sm_count: int | None = None,
    device_kind: str | None = None,
    few_tokens: bool = False,
    act_quant: ActivationQuant = ActivationQuant.NONE,
) -> DecodeTile:
    """Pure heuristic: the tile of one decode kernel with ``n`` output columns (per half),
    contraction ``k``, and ``num_programs_per_column`` expected busy expert slots.

    Decode reads each selected expert's weights once, so the program count is what fills the
    GPU: ``block_n`` shrinks until the busy programs cover every SM twice, but not below 64
    for the quantized formats (32 for BF16): in-register dequantization costs per-step work
    that only wide tiles amortize (64 weight rows are also the smallest wgmma M under
    ``swap_ab``; the SASS of sm_90 builds showed 2-3x more instructions per weight byte at
    32 rows than at 64). ``block_k`` gives 128-256 bytes of contiguous weight per row and K
    step; ``num_stages`` keeps 2-4 steps in flight; 4 warps (8 doubled the per-byte
    instruction count in the same SASS comparison). ``act_quant`` fp8 (W8A8): e4m3 activations,
    e4m3 x e4m3 dots (no f16 route), ``block_k`` dividing the activation group (128).

    ``few_tokens`` (1..3 tokens): ``block_n`` stops at 64 for BF16 too, unsplit. Measured on
    the H200 (Qwen3-30B-A3B, 1 token, kernels alone, device time in a jitted scan): 39.8 us
    against 42.4 us for 32-wide tiles; splitting K (``split_k`` 2-4, then with gate_up's
    partials activated in down's prologue) was slower at 1-3 tokens (61-144 us), so the
    heuristic leaves ``split_k`` at 1; it stays a tunable.
    """
    fmt = WeightFormat.coerce(fmt)
    match fmt:
        case WeightFormat.BF16:
            block_k = 128 if x_itemsize <= 2 else 64
        case WeightFormat.FP8_BLOCK:
            block_k = math.gcd(128, fp8_block[1])
        case WeightFormat.NVFP4 | WeightFormat.MXFP4:
            block_k = 128
    w8a8 = ActivationQuant.coerce(act_quant) is ActivationQuant.FP8
    if w8a8:
        block_k = max(2 * MIN_DOT, math.gcd(block_k, FP8_ACT_GROUP))
        x_itemsize = 1
    block_k = max(MIN_DOT, min(block_k, _next_pow2(k)))
    if fmt in FP4_FORMATS:
        block_k = max(block_k, 2 * MIN_DOT, NVFP4_GROUP if fmt is WeightFormat.NVFP4 else
                      MXFP4_GROUP)

    block_n = max(MIN_DOT, min(128 // halves, _next_pow2(n)))
    min_block_n = max(MIN_DOT, min(block_n, 32 if fmt is WeightFormat.BF16 and not few_tokens
                                   else 64))
    if sm_count is not None:
        while (block_n > min_block_n
               and num_programs_per_column * -(-n // block_n) < 2 * sm_count):
            block_n //= 2
    num_warps = 4

    stage_bytes = halves * block_n * block_k * _WEIGHT_BYTES[fmt] + MIN_DOT * block_k * x_itemsize
    budget = _shared_memory_budget(device_kind)
    num_stages = int(max(2, min(4, budget // max(stage_bytes, 1))))
    # GPU: the cheap conversions (W8A8 needs none)
    f16_dot = fmt in F16_DOT_FORMATS and sm_count is not None and not w8a8
    tile = DecodeTile(block_n=block_n, block_k=block_k, num_warps=num_warps,
                      num_stages=num_stages, f16_dot=f16_dot)
    tile.check_format(fmt, fp8_block=fp8_block, act_quant=act_quant)
    return tile


def choose_decode_config(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    fmt: WeightFormat,
    *,
    fp8_block: tuple[int, int] = (128, 128),
    x_itemsize: int = 2,
    sm_count: int | None = None,
    device_kind: str | None = None,
    gate_up_act_quant: ActivationQuant = ActivationQuant.NONE,
    down_act_quant: ActivationQuant = ActivationQuant.NONE,
) -> MoEDecodeConfig:
    """Pure heuristic: both tiles of a decode step (``sm_count`` / ``device_kind`` from the
    device, None off GPU: then no occupancy rule and bf16 dots; ``*_act_quant`` fp8: that
    kernel's W8A8 tile)."""
    fmt = WeightFormat.coerce(fmt)
    busy = expected_distinct_experts(num_tokens, top_k, num_experts)
    common = dict(fp8_block=fp8_block, x_itemsize=x_itemsize, sm_count=sm_count,
                  device_kind=device_kind, num_programs_per_column=busy,
                  few_tokens=num_tokens <= FEW_TOKENS)
    gate_up = choose_tile(intermediate_size, hidden_size, fmt, halves=2,
                          act_quant=gate_up_act_quant, **common)
    programs = busy * -(-intermediate_size // gate_up.block_n)
    split = (ONE_TOKEN_FP4_GATE_UP_SPLIT if fmt in FP4_FORMATS else
             ONE_TOKEN_W8A8_GATE_UP_SPLIT
             if ActivationQuant.coerce(gate_up_act_quant) is ActivationQuant.FP8 else 1)
    if (sm_count is not None and num_tokens == 1 and split > 1 and programs < sm_count
            and -(-hidden_size // gate_up.block_k) >= 2 * split):
        gate_up = dataclasses.replace(gate_up, split_k=split)
    return MoEDecodeConfig(
        gate_up=gate_up,
        down=choose_tile(hidden_size, intermediate_size, fmt, halves=1,
                         act_quant=down_act_quant, **common),
    )
