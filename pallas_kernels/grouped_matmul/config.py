"""Static configuration of the grouped matmul: enums, tile config, tile heuristic.

Everything here is hashable and validated at construction, so it can be a static argument of
``jax.jit``. Nothing here imports ``atlas_jax``: enums that mirror library enums accept any enum
member (or string) with the same ``.value`` through ``coerce``.
"""

from __future__ import annotations

import dataclasses
import math

from pallas_kernels._enums import CoercibleEnum

# Elements of K that share one scale, per format (fixed by the formats themselves).
NVFP4_GROUP = 16  # one E4M3 scale per 16 E2M1 values along K
MXFP4_GROUP = 32  # one E8M0 scale per 32 E2M1 values along K
FP8_ACT_GROUP = 128  # W8A8: one f32 activation scale per token per 128 elements of K
FP8_E4M3_MAX = 448.0


class WeightFormat(CoercibleEnum):
    """Storage format of the expert weights ``w [G, N, K]`` (values match ``atlas_jax`` Format)."""

    BF16 = "bf16"  # w [G, N, K] bf16 (or f16/f32)
    FP8_BLOCK = "fp8_block"  # w [G, N, K] e4m3fn, scale_inv [G, cdiv(N,b0), cdiv(K,b1)] f32
    NVFP4 = "nvfp4"  # w [G, N, K//2] u8, scale [G, N, K//16] e4m3fn, global [G, R] f32
    MXFP4 = "mxfp4"  # w [G, N, K//2] u8, scale [G, N, K//32] u8 (E8M0 bits)


class Activation(CoercibleEnum):
    """Gated activation of the fused gate_up epilogue: ``out = act(gate) * up``."""

    SILU = "silu"  # SwiGLU: silu(gate) * up
    GELU_TANH = "gelu_tanh"  # GeGLU: gelu_tanh(gate) * up
    GPT_OSS = "gpt_oss"  # g=min(gate,limit), u=clip(up,-limit,limit), (u+1)*g*sigmoid(alpha*g)


class GateUpLayout(CoercibleEnum):
    """Where the gate and up rows of a fused ``w [G, 2I, K]`` live."""

    CONCATENATED = "concatenated"  # gate rows [0, I), up rows [I, 2I)
    INTERLEAVED = "interleaved"  # gate = even rows, up = odd rows (gpt-oss)


class ActivationQuant(CoercibleEnum):
    """Quantization of the activations ``x`` before the dot."""

    NONE = "none"  # x stays bf16/f16/f32; quantized weights are dequantized in-kernel
    FP8 = "fp8"  # W8A8: x -> e4m3 per token per 128 of K, scale = amax / 448


def _is_pow2(v: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile shape and Triton launch parameters of one grouped-matmul program.

    One program computes a ``[block_m, block_n]`` output tile of one group, looping over K in
    steps of ``block_k``. With a fused gate_up epilogue ``block_n`` counts output columns: the
    program holds two ``[block_m, block_n]`` accumulators (gate and up).
    """

    block_m: int  # rows of x per program (Triton dots need >= 16)
    block_n: int  # output columns per program
    block_k: int  # K per loop step; for FP8 it must divide the scale block along K
    num_warps: int = 4
    num_stages: int = 3  # software-pipelining depth of the K loop
    # Compute the transposed tile, dot(w [bn, bk], x^T [bk, bm]): the weight tile becomes the
    # MMA's M operand (Hopper wgmma needs M >= 64 but takes N >= 8, and takes A from registers,
    # where in-kernel dequantized weights already are). For decode-sized block_m.
    swap_ab: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if not _is_pow2(v) or not 16 <= v <= 512:
                raise ValueError(
                    f"TileConfig.{name}: expected a power of two in [16, 512], got {v!r}"
                )
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"TileConfig.num_warps: expected one of 1, 2, 4, 8, 16, got {self.num_warps!r}"
            )
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(
                f"TileConfig.num_stages: expected an int in [1, 8], got {self.num_stages!r}"
            )
        if not isinstance(self.swap_ab, bool):
            raise ValueError(f"TileConfig.swap_ab: expected a bool, got {self.swap_ab!r}")

    def check_format(
        self,
        fmt: WeightFormat,
        *,
        fp8_block: tuple[int, int] = (128, 128),
        act_quant: ActivationQuant = ActivationQuant.NONE,
    ) -> None:
        """Raises ValueError when this tile cannot run the given weight/activation format."""
        fmt = WeightFormat.coerce(fmt)
        act_quant = ActivationQuant.coerce(act_quant)
        bk = self.block_k
        match fmt:
            case WeightFormat.FP8_BLOCK:
                if fp8_block[1] % bk:
                    raise ValueError(
                        f"TileConfig.block_k: FP8_BLOCK needs block_k to divide the scale block "
                        f"along K ({fp8_block[1]}), got {bk}"
                    )
            case WeightFormat.NVFP4:
                if bk % NVFP4_GROUP:
                    raise ValueError(
                        f"TileConfig.block_k: NVFP4 needs a multiple of {NVFP4_GROUP}, got {bk}"
                    )
            case WeightFormat.MXFP4:
                if bk % MXFP4_GROUP:
                    raise ValueError(
                        f"TileConfig.block_k: MXFP4 needs a multiple of {MXFP4_GROUP}, got {bk}"
                    )
            case WeightFormat.BF16:
                pass
        if act_quant is ActivationQuant.FP8 and (FP8_ACT_GROUP % bk or bk < 32):
            raise ValueError(
                f"TileConfig.block_k: W8A8 needs block_k in [32, {FP8_ACT_GROUP}] dividing "
                f"{FP8_ACT_GROUP} (fp8 dots take K >= 32), got {bk}"
            )




def _shared_memory_budget(kind: str | None) -> int:
    """Bytes of shared memory a program may use for its pipelined tiles (leaves headroom)."""
    if kind is not None and any(
        s in kind for s in ("H100", "H200", "H800", "H20", "GH200", "B200", "B300", "GB200")
    ):
        return 200 * 1024  # 227 KB opt-in on sm_90/sm_100
    if kind is not None and "A100" in kind:
        return 150 * 1024  # 163 KB on sm_80
    return 90 * 1024  # sm_86/89/120 (99-101 KB) and unknown devices


def _next_pow2(v: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(v, 1))))


def choose_tile_config(
    m: int,
    n: int,
    k: int,
    num_groups: int,
    fmt: WeightFormat,
    *,
    fused_gate_up: bool = False,
    act_quant: ActivationQuant = ActivationQuant.NONE,
    fp8_block: tuple[int, int] = (128, 128),
    x_itemsize: int = 2,
    sm_count: int | None = None,
    device_kind: str | None = None,
) -> TileConfig:
    """Pure heuristic: a tile for an ``[m, k] x [num_groups, n, k]`` grouped matmul.

    ``n`` counts output columns (``I`` for a fused gate_up). ``sm_count`` and ``device_kind``
    come from the device (``device_sm_count()`` / ``device_kind()``); when None the occupancy
    rule is skipped and a conservative shared-memory budget is used.
    """
    fmt = WeightFormat.coerce(fmt)
    act_quant = ActivationQuant.coerce(act_quant)
    halves = 2 if fused_gate_up else 1

    # Rows per group under uniform routing: decode gives a handful, prefill hundreds.
    rows_per_group = max(1, -(-m // max(num_groups, 1)))
    block_m = min(128, max(16, _next_pow2(rows_per_group)))

    # K step: 64 for bf16 weights with big tiles, 128 when weight bytes per element are small.
    match fmt:
        case WeightFormat.BF16:
            block_k = 64 if block_m >= 64 else 128
        case WeightFormat.FP8_BLOCK:
            block_k = math.gcd(128, fp8_block[1])
        case WeightFormat.NVFP4 | WeightFormat.MXFP4:
            block_k = 128
    if act_quant is ActivationQuant.FP8:
        block_k = math.gcd(block_k, FP8_ACT_GROUP)
    block_k = max(16, min(block_k, _next_pow2(k)))
    if fmt is WeightFormat.MXFP4:
        block_k = max(block_k, 32)
    if act_quant is ActivationQuant.FP8:
        block_k = max(block_k, 32)

    # Output columns. Accumulator budget per program (both halves when fused): 128x256 f32 over
    # 8 warps when bf16 weights go straight from memory to the MMA, 128x128 when weights are
    # converted in registers first (those registers come out of the same budget).
    direct = fmt is WeightFormat.BF16
    block_n = (256 if block_m >= 128 and direct else 128) // halves
    block_n = max(16, min(block_n, _next_pow2(n)))

    # Decode is bound by weight bytes: split N until the grid covers every SM twice.
    if sm_count is not None:
        est_tiles = min(m, -(-m // block_m) + min(num_groups, m))
        while block_n > 32 and est_tiles * -(-n // block_n) < 2 * sm_count:
            block_n //= 2

    acc_elems = block_m * block_n * halves
    num_warps = 8 if acc_elems >= 128 * 128 else 4

    # Pipelining depth from the shared memory one stage takes (raw, still-packed weight bytes).
    w_bytes = {
        WeightFormat.BF16: 2.0,
        WeightFormat.FP8_BLOCK: 1.0,
        WeightFormat.NVFP4: 0.5 + 1 / NVFP4_GROUP,
        WeightFormat.MXFP4: 0.5 + 1 / MXFP4_GROUP,
    }[fmt]
    x_bytes = 1 if act_quant is ActivationQuant.FP8 else x_itemsize
    stage_bytes = block_m * block_k * x_bytes + halves * block_n * block_k * w_bytes
    budget = _shared_memory_budget(device_kind)
    num_stages = int(max(2, min(4, budget // max(stage_bytes, 1))))
    # Small row tiles: let the weight tile be the MMA's M operand.
    swap_ab = block_m < 64
    tile = TileConfig(block_m, block_n, block_k, num_warps, num_stages, swap_ab)
    tile.check_format(fmt, fp8_block=fp8_block, act_quant=act_quant)
    return tile
