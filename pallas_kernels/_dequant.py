"""In-kernel dequantization shared by the Pallas kernels (grouped matmul, MoE decode, paged
decode): the one home of the bit-level conversions of E2M1 (NVFP4 / MXFP4 values), E8M0 (MXFP4
scales) and E4M3 (FP8 scales) codes. (E4M3 values need no helper: Triton converts e4m3 -> f16
with one packed ``cvt.rn.f16x2.e4m3x2`` per two values; the same instruction as inline PTX took
more instructions in the sm_90 build, a ``prmt`` per pair to pack the asm's 16-bit operand.)

Everything is elementwise on register tiles: no table gathers, which Triton has no cheap form
of. The packed conversions have two paths that give the same bits: inline PTX through
``plgpu.elementwise_inline_asm`` (``inline_asm=True``, the GPU: two values per 32-bit op) and a
plain-jnp twin (``inline_asm=False``: interpret mode, where PTX cannot run).
``tests/test_dequant.py`` checks the twins against the formats' reference dequantization on
every code and the PTX's bit logic, emulated, against the twins on every input.

Scaled f16 results. f16 has 5 exponent bits, so E2M1 codes are placed into an f16 *below*
their value, ``e2m1 * 2^-14`` (``F16_FP4_FACTOR``): exact for every code (the smallest land on
f16 subnormals, which f16 arithmetic and f16 MMAs keep); the caller multiplies the factor back
once, on an f32 per-row / per-column / per-token factor or the accumulator. A product
``e2m1 * 2^-14 * s`` with an E4M3 block scale ``s`` is exact in f16 as well: ``e2m1`` has 2
significant bits with the lowest >= 2^-1, ``s`` 4 with the lowest >= 2^-9, so the product has
<= 6 significant bits, all >= 2^-24 (the f16 subnormal step), and stays below
``6 * 448 * 2^-14 < 1``. (So is its cast to bf16: 6 bits fit bf16's 8, and 2^-24 is far inside
bf16's normal range.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

F16_FP4_FACTOR = 2.0**14  # fp4_to_f16_scaled / e2m1_to_f16_scaled give e2m1 * 2^-14

# ---------------------------------------------------------------------------------------------
# Scalar-per-element conversions (jnp; Triton lowers them to a few integer ops each).
# ---------------------------------------------------------------------------------------------


def e2m1_to_f32(codes):
    """int32 E2M1 codes in [0, 16) -> float32, built from bits.

    For magnitude code ``m = eem`` (exponent e, mantissa m) the float32 with exponent field
    ``e + 126`` and mantissa top bit ``m`` is ``2^(e-1) * (1 + m/2)``: exact for e > 0. The two
    subnormal codes (0 -> 0, 1 -> 0.5) are ``mag * 0.5``. Bit 3 is the sign.
    """
    mag = codes & 7
    normal = jax.lax.bitcast_convert_type((mag << 22) + (126 << 23), jnp.float32)
    val = jnp.where(mag < 2, mag.astype(jnp.float32) * 0.5, normal)
    return jnp.where(codes >= 8, -val, val)


def e8m0_to_f32(bits):
    """int32 E8M0 bits -> 2^(bits - 127) as float32 by placing them in the exponent field
    (bits = 0 gives 0 instead of 2^-127, 255 gives inf instead of NaN)."""
    return jax.lax.bitcast_convert_type(bits << 23, jnp.float32)


def e8m0_step_to_f16(d):
    """int32 exponent steps ``d <= 0`` -> float16 ``2^d`` by bit placement: normal for
    ``d >= -14``, subnormal down to ``2^-24``, 0 below. The MXFP4 f16 route's factor of a scale
    block relative to the largest scale of its K step (``2^(s - s_max)``): multiplied into
    ``e2m1 * 2^-14`` it is exact for ``d >= -9`` (the product's lowest bit, ``2^(-15 + d)``,
    stays >= 2^-24); further below, f16 rounds the product to a multiple of 2^-24."""
    normal = (jnp.maximum(d, -14) + 15) << 10
    sub = jnp.left_shift(1, jnp.clip(d + 24, 0, 9))
    bits = jnp.where(d >= -14, normal, jnp.where(d >= -24, sub, 0))
    return jax.lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.float16)


def e2m1_to_f16_scaled(codes):
    """int32 E2M1 codes (low 4 bits) -> float16 ``e2m1 * 2^-14``, by bit placement.

    The magnitude bits ``eem`` go to the lowest two exponent bits and the top mantissa bit of
    an f16, the sign to the sign bit: for e > 0 that is ``2^(e-15) * (1 + m/2)``, for e = 0 the
    subnormal ``m * 2^-15``; both are ``e2m1 * 2^-14``. A few integer ops, no selects.
    """
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.float16)


# ---------------------------------------------------------------------------------------------
# Packed conversions: inline PTX on the GPU, the same bits in jnp elsewhere.
# ---------------------------------------------------------------------------------------------

# NVFP4 / MXFP4 nibbles. Two packed bytes per instance ($1, 16 bits) -> two f16 ``e2m1 *
# 2^-14`` in one 32-bit register ($0): of their low nibbles (even k; SHIFT_M 9, SHIFT_S 12) or
# high nibbles (odd k; 5 and 8). ``prmt`` spreads the two bytes into the two 16-bit lanes, then
# each nibble's magnitude bits go to bits 9-11 and its sign bit to bit 15 of its lane
# (``e2m1_to_f16_scaled``'s bit placement, both lanes per 32-bit op). Two launches of the asm,
# not one with two results: Pallas lowers a multi-result elementwise_inline_asm to one value.
_FP4_TO_F16_ASM = """{
.reg .b32 t, a, b, z;
mov.b32 z, 0;
cvt.u32.u16 t, $1;
prmt.b32 t, t, z, 0x4140;
shl.b32 a, t, SHIFT_M; and.b32 a, a, 0x0E000E00;
shl.b32 b, t, SHIFT_S; and.b32 b, b, 0x80008000;
or.b32 $0, a, b;
}"""


def fp4_to_f16_scaled(packed, inline_asm: bool):
    """uint8 ``[r, c]`` packed E2M1 pairs -> (low nibbles, high nibbles) as f16 ``e2m1 * 2^-14``
    ``[r, c]`` each (the even and odd k of the packing). ``inline_asm``: the PTX above (GPU);
    else the same bits in jnp."""
    if inline_asm:
        out = jax.ShapeDtypeStruct(packed.shape, jnp.float16)
        return tuple(
            plgpu.elementwise_inline_asm(
                _FP4_TO_F16_ASM.replace("SHIFT_M", str(m)).replace("SHIFT_S", str(s)),
                args=[packed], constraints="=r,h", pack=2, result_shape_dtypes=[out])[0]
            for m, s in ((9, 12), (5, 8)))
    codes = packed.astype(jnp.int32)
    return e2m1_to_f16_scaled(codes), e2m1_to_f16_scaled(codes >> 4)


# NVFP4 / MXFP4 nibbles, four packed bytes per instance ($2, 32 bits) -> four f16 ``e2m1 *
# 2^-14`` in two registers ($0: bytes 0-1, $1: bytes 2-3), of the low nibbles (``_LO``) or the
# high nibbles (``_HI``). The bit placement is done on all four bytes at once (SIMD within the
# register: no shift or mask crosses a byte), giving per byte ``H = sign << 7 | mag << 1``, the
# high byte of the f16 (its low byte is 0); two ``prmt`` then put bytes 0, 1 (2, 3) of H into
# the high bytes of the two 16-bit lanes. 5-6 ops per four values, against 9 per two bytes'
# worth (four values) in ``_FP4_TO_F16_ASM``. $3 is the same guard as ``_FP8_TO_F16_ASM``'s
# (below): without it Triton moved the conversion into the MMA-operand layout and the packed
# bytes were read from shared memory two at a time and re-packed with a ``prmt`` per byte,
# which cost more than the ``_FP4_TO_F16_ASM`` form (offline sm_90 build of the MoE decode
# kernel); with it, 16-byte shared loads, and the f16 operand reaches the MMA layout through
# ``ldmatrix``.
_FP4X4_TO_F16_LO_ASM = """{
.reg .b32 a, b, h;
shl.b32 a, $2, 4; and.b32 a, a, 0x80808080;
shl.b32 b, $2, 1; and.b32 b, b, 0x0E0E0E0E;
or.b32 h, a, b;
prmt.b32 $0, h, 0, 0x1404;
prmt.b32 $1, h, 0, 0x3424;
}"""
_FP4X4_TO_F16_HI_ASM = """{
.reg .b32 a, b, h;
and.b32 a, $2, 0x80808080;
shr.b32 b, $2, 3; and.b32 b, b, 0x0E0E0E0E;
or.b32 h, a, b;
prmt.b32 $0, h, 0, 0x1404;
prmt.b32 $1, h, 0, 0x3424;
}"""


def fp4x4_to_f16_scaled(packed, inline_asm: bool):
    """``fp4_to_f16_scaled`` (the same values) with four bytes per PTX instance and the guard
    operand that keeps the conversion before the change to the MMA-operand layout (the MoE
    decode kernel). ``packed``: uint8 ``[r, c]``. ``inline_asm=False``: the jnp twin."""
    if not inline_asm:
        return fp4_to_f16_scaled(packed, False)
    out = jax.ShapeDtypeStruct(packed.shape, jnp.float16)
    guard = _guard(packed.shape)
    return tuple(
        plgpu.elementwise_inline_asm(asm, args=[packed, guard], constraints="=r,=r,r,r",
                                     pack=4, result_shape_dtypes=[out])[0]
        for asm in (_FP4X4_TO_F16_LO_ASM, _FP4X4_TO_F16_HI_ASM))


# E4M3 values (FP8 KV pages), converted in registers right after the load. Four bytes per
# instance in one 32-bit register ($2) -> four f16 in two ($0: bytes 0-1, $1: bytes 2-3), one
# packed ``cvt.rn.f16x2.e4m3x2`` per half (``mov.b32 {lo, hi}`` splits the register for free:
# no ``prmt``, unlike a 16-bit-operand form). $3 is unused: a "guard" operand. Triton's
# dot-operand hoisting (OptimizeDotOperands' HoistLayoutConversion) moves the change to the MMA
# operand layout above elementwise ops -- casts, arith, and pure inline asm -- as long as the
# walk up from the convert meets a load or a constant before any other op; it did so with a
# unary asm and with a constant second operand (offline sm_90 build: V still read from shared
# memory one byte at a time). The guard is a row index broadcast along the columns: a
# ``broadcast`` is not hoistable and, as the asm's last operand, it is met first, so the layout
# change stays after the conversion, on f16 data.
_FP8_TO_F16_ASM = """{
.reg .b16 lo, hi;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi;
}"""


def fp8_to_f16(x, inline_asm: bool):
    """float8_e4m3fn ``[r, c]`` -> float16 ``[r, c]`` (exact). ``inline_asm``: the PTX above
    (GPU: an elementwise op the compiler keeps where it is written); else ``astype``
    (interpret mode; the same values)."""
    if not inline_asm:
        return x.astype(jnp.float16)
    out = jax.ShapeDtypeStruct(x.shape, jnp.float16)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint8)
    return plgpu.elementwise_inline_asm(
        _FP8_TO_F16_ASM, args=[bits, _guard(x.shape)], constraints="=r,=r,r,r", pack=4,
        result_shape_dtypes=[out])[0]


def _guard(shape) -> jax.Array:
    """The unused last operand of the guarded conversions above: uint8 row indices broadcast
    along the columns (a broadcast Triton does not hoist a layout change past)."""
    rows = jnp.arange(shape[0], dtype=jnp.int32).astype(jnp.uint8)
    return jnp.broadcast_to(rows[:, None], shape)
