"""pallas_kernels._dequant: every conversion against its format's reference dequantization on
all codes, the jnp twins of the PTX paths bit for bit, and the PTX's bit logic emulated."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import _dequant as dq
from pallas_kernels.grouped_matmul.reference import E2M1_VALUES

_MAG = np.asarray(E2M1_VALUES, np.float64)
E2M1 = np.concatenate([_MAG, -_MAG])  # [16]: code -> value (bit 3: sign)
CODES16 = np.arange(16, dtype=np.int32)
BYTES = np.arange(256, dtype=np.int32)
E4M3_FINITE = BYTES[(BYTES & 0x7F) != 0x7F]  # 0x7F / 0xFF are E4M3's NaN


def _bits16(a) -> np.ndarray:
    return np.asarray(a).view(np.uint16)


def _e4m3_values(codes) -> np.ndarray:
    return codes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def test_e2m1_to_f32_all_codes():
    got = np.asarray(dq.e2m1_to_f32(jnp.asarray(CODES16)))
    np.testing.assert_array_equal(got.astype(np.float64), E2M1)


def test_e8m0_to_f32_all_finite_codes():
    bits = np.arange(1, 255, dtype=np.int32)
    got = np.asarray(dq.e8m0_to_f32(jnp.asarray(bits)))
    np.testing.assert_array_equal(got, np.exp2(bits - 127.0).astype(np.float32))


def test_e2m1_to_f16_scaled_all_codes():
    got = np.asarray(dq.e2m1_to_f16_scaled(jnp.asarray(CODES16)))
    assert got.dtype == np.float16
    np.testing.assert_array_equal(_bits16(got), _bits16((E2M1 * 2.0**-14).astype(np.float16)))
    np.testing.assert_array_equal(got.astype(np.float64) * dq.F16_FP4_FACTOR, E2M1)


def test_fp4_to_f16_scaled_twin_all_bytes():
    """The jnp twin on all 256 packed bytes: low nibble = even k, high nibble = odd k."""
    lo, hi = dq.fp4_to_f16_scaled(jnp.asarray(BYTES.astype(np.uint8)).reshape(16, 16), False)
    for got, nib in ((lo, BYTES & 0xF), (hi, BYTES >> 4)):
        want = (E2M1[nib] * 2.0**-14).astype(np.float16).reshape(16, 16)
        np.testing.assert_array_equal(_bits16(got), _bits16(want))


def test_fp4_asm_bit_logic_all_byte_pairs():
    """The PTX emulated on every 16-bit pair of bytes (element 0 in the low byte, Triton's
    packing): the same bits as the jnp twin, both lanes."""
    asm = dq._FP4_TO_F16_ASM
    assert "cvt.u32.u16 t, $1;" in asm and "prmt.b32 t, t, z, 0x4140;" in asm
    pair = np.arange(1 << 16, dtype=np.uint32)
    t = (pair & 0xFF) | ((pair >> 8) << 16)  # prmt 0x4140: byte 0 -> lane 0, byte 1 -> lane 1
    elems = np.stack([pair & 0xFF, pair >> 8], axis=1).astype(np.uint8)  # [65536, 2]
    twins = dq.fp4_to_f16_scaled(jnp.asarray(elems), False)
    for (sm, ss), twin in zip(((9, 12), (5, 8)), twins, strict=True):
        text = asm.replace("SHIFT_M", str(sm)).replace("SHIFT_S", str(ss))
        assert f"shl.b32 a, t, {sm};" in text and f"shl.b32 b, t, {ss};" in text
        r = (((t << sm) & 0x0E000E00) | ((t << ss) & 0x80008000)).astype(np.uint32)
        got = r.astype("<u4").view("<u2").reshape(-1, 2)  # lane 0 = low half
        np.testing.assert_array_equal(got, _bits16(twin))


def _prmt(h, sel):
    """PTX ``prmt.b32 d, h, 0, sel`` (default mode, selectors < 8): byte i of d is byte
    ``sel >> 4i & 7`` of the pair (h: bytes 0-3, 0: bytes 4-7)."""
    out = np.zeros_like(h)
    for i in range(4):
        src = (sel >> (4 * i)) & 7
        byte = (h >> (8 * src)) & 0xFF if src < 4 else np.zeros_like(h)
        out |= byte << (8 * i)
    return out


def test_fp4x4_asm_bit_logic():
    """The four-byte PTX emulated on words of four bytes (element i in byte i; every byte value
    in every position, next to every other): the same bits as the jnp twin."""
    lo_asm, hi_asm = dq._FP4X4_TO_F16_LO_ASM, dq._FP4X4_TO_F16_HI_ASM
    for asm in (lo_asm, hi_asm):
        assert "prmt.b32 $0, h, 0, 0x1404;" in asm and "prmt.b32 $1, h, 0, 0x3424;" in asm
    assert "shl.b32 a, $2, 4; and.b32 a, a, 0x80808080;" in lo_asm
    assert "shl.b32 b, $2, 1; and.b32 b, b, 0x0E0E0E0E;" in lo_asm
    assert "and.b32 a, $2, 0x80808080;" in hi_asm
    assert "shr.b32 b, $2, 3; and.b32 b, b, 0x0E0E0E0E;" in hi_asm
    pair = np.arange(1 << 16, dtype=np.uint64)
    rng = np.random.default_rng(0)
    other = rng.integers(0, 1 << 16, size=pair.shape, dtype=np.uint64)
    m = np.uint64(0xFFFFFFFF)
    for w in (pair | (other << 16), other | (pair << 16)):  # [65536] words
        elems = np.stack([(w >> (8 * i)) & 0xFF for i in range(4)], axis=1).astype(np.uint8)
        twins = dq.fp4x4_to_f16_scaled(jnp.asarray(elems), False)
        h_lo = (((w << 4) & m) & 0x80808080) | (((w << 1) & m) & 0x0E0E0E0E)
        h_hi = (w & 0x80808080) | ((w >> 3) & 0x0E0E0E0E)
        for h, twin in ((h_lo, twins[0]), (h_hi, twins[1])):
            regs = np.stack([_prmt(h, 0x1404), _prmt(h, 0x3424)], axis=1).astype(np.uint32)
            got = regs.astype("<u4").view("<u2").reshape(-1, 4)  # lane 0 = low half
            np.testing.assert_array_equal(got, _bits16(twin))


@pytest.mark.parametrize("dot_dtype", [np.float16, ml_dtypes.bfloat16])
def test_nvfp4_f16_products_exact(dot_dtype):
    """The module's claim: ``f16(e2m1 * 2^-14) * f16(e4m3 scale)`` rounds nowhere, for every
    (code, finite scale) pair, and neither does its cast to bf16."""
    vals = np.asarray(dq.e2m1_to_f16_scaled(jnp.asarray(CODES16)))[:, None]  # [16, 1] f16
    scales = _e4m3_values(E4M3_FINITE)[None, :]  # [1, S]
    prod = vals * scales.astype(np.float16)  # f16 products
    exact = E2M1[:, None] * 2.0**-14 * scales
    np.testing.assert_array_equal(prod.astype(np.float64), exact)
    np.testing.assert_array_equal(prod.astype(dot_dtype).astype(np.float64), exact)


def test_e8m0_step_to_f16_and_mxfp4_products():
    """``2^d`` for every step d in [-40, 0] (0 below 2^-24); the products with ``e2m1 *
    2^-14`` are exact for d >= -9 and within half an f16 subnormal step (2^-25) below."""
    d = np.arange(-40, 1, dtype=np.int32)
    got = np.asarray(dq.e8m0_step_to_f16(jnp.asarray(d)))
    assert got.dtype == np.float16
    want = np.where(d >= -24, np.exp2(d.astype(np.float64)), 0.0)
    np.testing.assert_array_equal(got.astype(np.float64), want)
    vals = np.asarray(dq.e2m1_to_f16_scaled(jnp.asarray(CODES16)))[:, None]  # [16, 1]
    prod = (vals * got[None, :]).astype(np.float64)  # f16 products
    exact = E2M1[:, None] * 2.0**-14 * np.exp2(d.astype(np.float64))[None, :]
    np.testing.assert_array_equal(prod[:, d >= -9], exact[:, d >= -9])
    assert np.abs(prod - exact).max() <= 2.0**-25
