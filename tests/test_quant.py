"""Tests of ``atlas_jax.quant``: bit-exact codes and scales per format, round trips, QTensor.

Every format is checked three ways: hand-computed bytes, an independent numpy / ml_dtypes
reference (for NVFP4 a transcription of ModelOpt's ``NVFP4QTensor.quantize``), and hypothesis
error-bound properties. CPU only, deterministic (seeded numpy, derandomized hypothesis).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from atlas_jax.quant import (
    Format,
    QTensor,
    _fp4,
    concat_rows,
    dequantize,
    fp8,
    mxfp4,
    nvfp4,
    quantize,
    reblock_rows,
)

F4, E4M3, E8M0 = ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e8m0fnu
PROPS = settings(derandomize=True, max_examples=25, deadline=None)

quantize_jit = jax.jit(quantize, static_argnames=("fmt", "block_size", "dtype"))
dequantize_jit = jax.jit(dequantize, static_argnames=("dtype",))


def np_(x) -> np.ndarray:
    """Host copy; float8 arrays as their uint8 bits so comparisons are bit comparisons."""
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype in (E4M3, E8M0) else x


def bits32(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def normal_only(w) -> np.ndarray:
    """Zero out |w| < 2^-100. XLA:CPU computes with denormals flushed to zero (FTZ/DAZ) while
    numpy does not; keeping every intermediate normal makes the comparisons meaningful."""
    return np.where(np.abs(w) < 2.0**-100, 0, w).astype(np.float32)


def scaled_blocks(rng, shape, block, spread=30):
    """Random normals, each K-block scaled by 2^U(-spread, spread): tiny blocks next to big ones
    exercise subnormal and underflowing block scales."""
    *lead, n, k = shape
    e = rng.integers(-spread, spread + 1, size=(*lead, n, k // block, 1))
    w = rng.standard_normal((*lead, n, k // block, block)) * np.exp2(e)
    return w.reshape(shape).astype(np.float32)


# ---- E2M1 codes and nibbles -------------------------------------------------------------------


class TestFp4:
    def test_encode_explicit(self):
        x = [0, -0.0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 5.5, 7, -7, -0.1, np.inf]
        want = [0, 8, 0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 15, 8, 7]  # RNE ties, saturation at 6
        np.testing.assert_array_equal(_fp4.encode(jnp.array(x, jnp.float32)), want)

    def test_encode_matches_ml_dtypes(self):
        rng = np.random.default_rng(0)
        vals = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
        mids = (vals[1:] + vals[:-1]) / 2
        near = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, 9), vals])
        x = np.concatenate([near, -near, rng.standard_normal(4096) * 4, [1e30, -1e-30]])
        x = x.astype(np.float32)
        want = np.clip(x, -6, 6).astype(F4).view(np.uint8)
        np.testing.assert_array_equal(_fp4.encode(jnp.asarray(x)), want)
        xb = x.astype(ml_dtypes.bfloat16)  # bf16 -> e2m1 directly, no float32 detour
        want_b = np.clip(xb, -6, 6).astype(F4).view(np.uint8)
        np.testing.assert_array_equal(_fp4.encode(jnp.asarray(xb)), want_b)

    def test_decode_all_codes(self):
        got = np.asarray(_fp4.decode(jnp.arange(16, dtype=jnp.uint8)))
        want = np.arange(16, dtype=np.uint8).astype(jnp.uint4).view(F4).astype(np.float32)
        np.testing.assert_array_equal(bits32(got), bits32(want))
        np.testing.assert_array_equal(got[:8], [0, 0.5, 1, 1.5, 2, 3, 4, 6])
        assert np.signbit(got[8]) and got[8] == 0  # 0x8 is -0

    def test_nibble_order(self):
        packed = _fp4.pack(jnp.array([[1, 2, 3, 4]], jnp.uint8))
        np.testing.assert_array_equal(packed, [[0x21, 0x43]])  # low nibble = even k
        np.testing.assert_array_equal(
            _fp4.unpack(jnp.array([0x21, 0xF0], jnp.uint8)), [1, 2, 0, 15]
        )

    @PROPS
    @given(hnp.arrays(np.uint8, (3, 2, 8)))
    def test_pack_unpack_identity(self, b):
        codes = _fp4.unpack(jnp.asarray(b))
        chex.assert_shape(codes, (3, 2, 16))
        assert int(codes.max()) < 16
        np.testing.assert_array_equal(_fp4.pack(codes), b)
        np.testing.assert_array_equal(_fp4.unpack(_fp4.pack(codes)), codes)


# ---- NVFP4 ------------------------------------------------------------------------------------

_E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5], np.float32)


def modelopt_nvfp4_reference(w):
    """numpy transcription of ModelOpt ``NVFP4QTensor.quantize`` (block 16, no padding).

    Returns ``(packed u8, scale e4m3, g [*L, 1] f32, nan_x)``; ``nan_x`` marks elements where
    ModelOpt divides 0 by 0 (scale underflowed to 0), whose codes we do not reproduce.
    """
    w = np.asarray(w, np.float32)
    *lead, n, k = w.shape
    g = (np.abs(w).max(axis=(-2, -1)) / np.float32(6.0 * 448.0))[..., None, None]
    wb = w.reshape(*lead, n, k // 16, 16)
    r = np.abs(wb).max(-1) / (np.float32(6.0) * g)
    r[r == 0] = 1.0
    s = r.astype(E4M3)
    with np.errstate(divide="ignore", invalid="ignore"):
        x = (wb / (s.astype(np.float32) * g)[..., None]).reshape(w.shape)
    sign = (x < 0).astype(np.uint8)
    a = np.abs(x)
    q = sign << 3
    q += np.searchsorted(_E2M1_MIDPOINTS, a, side="left").astype(np.uint8)
    q += np.isin(a, _E2M1_MIDPOINTS[[1, 3, 5]]).astype(np.uint8)
    return (q[..., 1::2] << 4) | q[..., 0::2], s, g[..., 0], np.isnan(x)


def assert_nvfp4_matches_modelopt(w):
    qt = quantize_jit(jnp.asarray(w), Format.NVFP4)
    data, scale, g, nan_x = modelopt_nvfp4_reference(np.asarray(w, np.float32))
    np.testing.assert_array_equal(np_(qt.scale), scale.view(np.uint8))
    np.testing.assert_array_equal(bits32(qt.global_scale), bits32(g))
    ours = np.asarray(_fp4.unpack(qt.data))
    theirs = np.asarray(_fp4.unpack(jnp.asarray(data)))
    np.testing.assert_array_equal(np.where(nan_x, 0, theirs), ours)  # ours: 0 where 0/0


class TestNvfp4:
    def test_explicit_bytes(self):
        b = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.0, -0.1, -6, 0.5, 1, 1.5, 2, 3]
        w = np.zeros((1, 48), np.float32)
        w[0, 0] = 2688.0  # amax -> g = 2688 / 2688 = 1, its block scale 448
        w[0, 16:32] = b  # block amax 6 -> scale 1; block 3 all zero -> scale 1
        qt = quantize_jit(w, Format.NVFP4)
        assert (qt.format, qt.shape, qt.block) == (Format.NVFP4, (1, 48), (1, 16))
        want = [0x07, 0, 0, 0, 0, 0, 0, 0]
        want += [0x07, 0x22, 0x44, 0x66, 0x80, 0x1F, 0x32, 0x54]  # -0.0 -> 0x0, -0.1 -> 0x8
        want += [0] * 8
        np.testing.assert_array_equal(qt.data, [want])
        np.testing.assert_array_equal(np_(qt.scale), [[0x7E, 0x38, 0x38]])  # 448, 1, 1
        np.testing.assert_array_equal(qt.global_scale, [1.0])
        want_w = [0, 0, 1, 1, 2, 2, 4, 4, 0, 0, -6, 0.5, 1, 1.5, 2, 3]
        np.testing.assert_array_equal(dequantize_jit(qt)[0, 16:32], [6] + want_w[1:])
        assert_nvfp4_matches_modelopt(w)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    def test_matches_modelopt_seeded(self, dtype):
        rng = np.random.default_rng(1)
        w = scaled_blocks(rng, (3, 16, 64), 16)
        w[0, 2] = 0.0  # zero blocks
        w[1, 3, :16] = -0.0
        w[2, 4, 16:32] *= 1e-12  # e4m3 scale underflows to 0
        w[2, 4, 20] = 0.0
        assert_nvfp4_matches_modelopt(np.asarray(jnp.asarray(w, dtype).astype(jnp.float32)))
        assert_nvfp4_matches_modelopt(jnp.asarray(w, dtype))

    def test_global_per_leading_index(self):
        rng = np.random.default_rng(6)
        w = rng.standard_normal((2, 3, 8, 64)) * np.arange(1, 7).reshape(2, 3, 1, 1)
        w = w.astype(np.float32)
        qt = quantize_jit(w, Format.NVFP4)
        chex.assert_shape(qt.global_scale, (2, 3, 1))
        g = np.abs(w).max(axis=(-2, -1)) / np.float32(2688)  # one per expert
        np.testing.assert_array_equal(qt.global_scale[..., 0], g)
        np.testing.assert_array_equal(nvfp4.global_scale(jnp.asarray(w)), g)
        for i, j in np.ndindex(2, 3):
            np.testing.assert_array_equal(
                qt.take(i).take(j).data, quantize_jit(w[i, j], Format.NVFP4).data
            )

    def test_all_zero_tensor_has_no_nan(self):
        qt = quantize_jit(jnp.zeros((2, 8, 32)), Format.NVFP4)
        np.testing.assert_array_equal(qt.data, 0)
        np.testing.assert_array_equal(np_(qt.scale), 0x38)  # scale 1.0
        np.testing.assert_array_equal(dequantize_jit(qt), 0)

    @PROPS
    @given(
        hnp.arrays(np.float32, (2, 8, 32), elements=st.floats(-8, 8, width=32)),
        hnp.arrays(np.int32, (2, 8, 2, 1), elements=st.integers(-40, 40)),
    )
    def test_matches_modelopt_property(self, base, exps):
        base = np.where(np.abs(base) < 2.0**-20, 0, base)  # |w| >= 2^-60: no denormals
        w = (base.reshape(2, 8, 2, 16) * np.exp2(exps.astype(np.float32))).reshape(2, 8, 32)
        assume(np.all(np.abs(w).max(axis=(-2, -1)) > 0))  # ModelOpt itself gives NaN there
        assert_nvfp4_matches_modelopt(w)

    @PROPS
    @given(hnp.arrays(np.float32, (2, 8, 32), elements=st.floats(-1e4, 1e4, width=32)))
    def test_roundtrip_error_bound(self, w):
        w = normal_only(w)
        qt = quantize_jit(jnp.asarray(w), Format.NVFP4)
        err = np.abs(np.asarray(dequantize_jit(qt)) - w).reshape(2, 8, 2, 16).max(-1)
        block_amax = np.abs(w).reshape(2, 8, 2, 16).max(-1)
        g = np.asarray(qt.global_scale)[..., None]  # [2, 1, 1]
        # rounding <= one step of the block scale s*g; s itself is within 2^-4 (rel.) or
        # 2^-10 (abs., subnormal e4m3) of block_amax / (6 g)
        bound = (17 / 16) * block_amax / 6 + 6 * 2.0**-10 * g
        assert np.all(err <= bound * (1 + 1e-5) + 1e-37)


# ---- MXFP4 ------------------------------------------------------------------------------------


def mxfp4_reference(w):
    """numpy / ml_dtypes OCP MX: e = clip(floor(log2 amax) - 2, -127, 127), frexp-based."""
    w = np.asarray(w, np.float32)
    wb = w.reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(wb).max(-1)
    e = np.where(amax == 0, -127, np.clip(np.frexp(amax)[1] - 1 - 2, -127, 127))
    x = (wb.astype(np.float64) / np.exp2(e.astype(np.float64))[..., None]).astype(np.float32)
    codes = np.clip(x, -6, 6).astype(F4).view(np.uint8).reshape(w.shape)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)), (e + 127).astype(np.uint8)


def gpt_oss_dequant_reference(blocks, scales):
    """numpy transcription of gpt-oss / HF ``convert_moe_packed_tensors`` (value table + ldexp)."""
    lut = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    out = np.empty((*blocks.shape[:-1], 32), np.float32)
    out[..., 0::2], out[..., 1::2] = lut[blocks & 0x0F], lut[blocks >> 4]
    out = np.ldexp(out, scales.astype(np.int32)[..., None] - 127)
    return out.reshape(*blocks.shape[:-2], -1)


class TestMxfp4:
    def test_explicit_bytes(self):
        w = np.zeros((5, 32), np.float32)
        w[0, :8] = [6, -6, 0.25, 0.75, 2.5, 3.5, 5, -0.0]  # amax 6: e = 2 - 2 = 0
        w[1, :2] = [7, 1]  # amax 7: e = 0, 7 saturates to 6
        w[2, :2] = [8, 3]  # amax 8: e = 1 -> 4, 1.5
        w[4, :2] = [1.0, 0.3125]  # amax 1: e = -2 -> 4, 1.25 -> 1 (tie to even)
        qt = quantize_jit(w, Format.MXFP4)
        np.testing.assert_array_equal(qt.scale[:, 0], [127, 127, 128, 0, 125])  # row 3: zero
        data = np.asarray(qt.data)
        np.testing.assert_array_equal(data[0, :4], [0xF7, 0x20, 0x64, 0x86])
        np.testing.assert_array_equal(data[1:, 0], [0x27, 0x36, 0x00, 0x26])
        assert not data[:, 4:].any() and not data[1:, 1:].any()
        np.testing.assert_array_equal(
            dequantize_jit(qt)[[1, 2, 4], :2], [[6, 1], [8, 3], [1, 0.25]]
        )

    def test_matches_reference_seeded(self):
        rng = np.random.default_rng(2)
        w = scaled_blocks(rng, (2, 8, 128), 32, spread=100)
        w[0, 0, :32] = 0.0
        w[1, 0, :32] = (1 + rng.random(32)) * 2.0**-126  # amax < 2^-125: e clamps to -127
        data, scale = mxfp4_reference(w)
        qt = quantize_jit(jnp.asarray(w), Format.MXFP4)
        np.testing.assert_array_equal(qt.scale, scale)
        np.testing.assert_array_equal(qt.data, data)
        assert qt.scale[1, 0, 0] == 0

    def test_shared_exponent_extremes(self):
        amax = jnp.array([0, 1e-40, 2.0**-125, 2.0**-124, 1.0, 5.99, 6.0, 8.0, 3.4e38], jnp.float32)
        np.testing.assert_array_equal(
            mxfp4.shared_exponent(amax), [0, 0, 0, 1, 125, 127, 127, 128, 252]
        )

    def test_e8m0_extremes(self):
        scales = np.array([0, 1, 127, 254, 255], np.uint8)
        want = np.array([2.0**-127, 2.0**-126, 1.0, 2.0**127, np.nan], np.float32)
        got = np.asarray(mxfp4.e8m0_to_float(jnp.asarray(scales)))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, scales.view(E8M0).astype(np.float32))
        blocks = np.full((5, 1, 16), 0x22, np.uint8)  # every value 1.0
        w = np.asarray(dequantize_jit(QTensor.from_mxfp4(blocks, scales[:, None])))
        np.testing.assert_array_equal(w[1:], np.broadcast_to(want[1:, None], (4, 32)))
        assert np.all((w[0] == want[0]) | (w[0] == 0))  # 1.0 * 2^-127 flushes on XLA:CPU
        big = QTensor.from_mxfp4(
            np.full((1, 1, 16), 0x77, np.uint8), np.full((1, 1), 254, np.uint8)
        )
        assert np.isinf(dequantize_jit(big)).all()  # 6 * 2^127 overflows float32

    def test_from_mxfp4_matches_gpt_oss(self):
        rng = np.random.default_rng(3)
        blocks = rng.integers(0, 256, (2, 3, 4, 16), dtype=np.uint8)
        scales = rng.integers(100, 150, (2, 3, 4), dtype=np.uint8)
        qt = QTensor.from_mxfp4(blocks, scales)
        assert (qt.shape, qt.data.shape, qt.block) == ((2, 3, 128), (2, 3, 64), (1, 32))
        got = np.asarray(dequantize_jit(qt))
        np.testing.assert_array_equal(
            bits32(got), bits32(gpt_oss_dequant_reference(blocks, scales))
        )

    @PROPS
    @given(hnp.arrays(np.float32, (3, 64), elements=st.floats(-(2.0**100), 2.0**100, width=32)))
    def test_roundtrip_error_bound_and_idempotence(self, w):
        w = normal_only(w)
        qt = quantize_jit(jnp.asarray(w), Format.MXFP4)
        w1 = np.asarray(dequantize_jit(qt))
        err = np.abs(w1 - w).reshape(3, 2, 32).max(-1)
        block_amax = np.abs(w).reshape(3, 2, 32).max(-1)
        assert np.all(err <= block_amax / 2 + 2.0**-127)  # [4, 8) * 2^e: saturation < 2^(e+1)
        w2 = np.asarray(dequantize_jit(quantize_jit(jnp.asarray(w1), Format.MXFP4)))
        np.testing.assert_array_equal(w2, w1)  # dequantized values are representable


# ---- FP8 block --------------------------------------------------------------------------------


def fp8_reference(w, block):
    w = np.asarray(w, np.float32)
    *lead, n, k = w.shape
    (b0, b1), nb0, nb1 = block, -(-n // block[0]), -(-k // block[1])
    wp = np.zeros((*lead, nb0 * b0, nb1 * b1), np.float32)
    wp[..., :n, :k] = w
    wb = wp.reshape(*lead, nb0, b0, nb1, b1)
    sinv = np.abs(wb).max(axis=(-3, -1)) / np.float32(448)
    sinv[sinv == 0] = 1.0
    q = np.clip(wb / sinv[..., :, None, :, None], -448, 448).astype(E4M3)
    return q.reshape(wp.shape)[..., :n, :k], sinv


class TestFp8:
    def test_explicit_bytes(self):
        w = np.zeros((5, 10), np.float32)
        w[0, 0], w[0, 1], w[1, 0], w[3, 7] = 896, 3, -1, 2.0**-8  # scale_inv 2
        w[4, 0], w[4, 1] = 0.875, -0.4375  # scale_inv 0.875 / 448 = 2^-9
        w[4, 9] = 1.0  # scale_inv f32(1 / 448)
        qt = quantize_jit(w, Format.FP8_BLOCK, block_size=(4, 8))
        assert (qt.shape, qt.block) == ((5, 10), (4, 8))
        np.testing.assert_array_equal(qt.scale, np.array([[2, 1], [2.0**-9, 1 / 448]], np.float32))
        q = np_(qt.data)
        # 448 = 0x7E, 1.5 = 0x3C, -0.5 = 0xB0, 2^-9 = 0x01 (min subnormal), -224 = 0xF6
        np.testing.assert_array_equal(
            [q[0, 0], q[0, 1], q[1, 0], q[3, 7]], [0x7E, 0x3C, 0xB0, 0x01]
        )
        np.testing.assert_array_equal([q[4, 0], q[4, 1], q[4, 9]], [0x7E, 0xF6, 0x7E])
        assert np.count_nonzero(q) == 7
        np.testing.assert_allclose(dequantize_jit(qt), w, rtol=1e-6)

    @pytest.mark.parametrize(
        "shape,block", [((2, 130, 200), (128, 128)), ((3, 13, 21), (4, 8)), ((64, 64), (128, 128))]
    )
    def test_matches_reference(self, shape, block):
        rng = np.random.default_rng(4)
        w = (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, shape))).astype(np.float32)
        w[..., : block[0], : block[1]] = 0  # a zero block
        q, sinv = fp8_reference(w, block)
        qt = quantize_jit(jnp.asarray(w), Format.FP8_BLOCK, block_size=block)
        chex.assert_shape(qt.scale, sinv.shape)
        np.testing.assert_array_equal(bits32(qt.scale), bits32(sinv))
        np.testing.assert_array_equal(np_(qt.data), q.view(np.uint8))
        rep = np.repeat(np.repeat(sinv, block[0], -2), block[1], -1)[..., : shape[-2], : shape[-1]]
        want = q.astype(np.float32) * rep
        np.testing.assert_array_equal(bits32(dequantize_jit(qt)), bits32(want))

    @PROPS
    @given(hnp.arrays(np.float32, (5, 10), elements=st.floats(-(2.0**100), 2.0**100, width=32)))
    def test_roundtrip_error_bound(self, w):
        w = normal_only(w)
        qt = quantize_jit(jnp.asarray(w), Format.FP8_BLOCK, block_size=(4, 8))
        sinv = np.repeat(np.repeat(np.asarray(qt.scale), 4, 0), 8, 1)[:5, :10]
        err = np.abs(np.asarray(dequantize_jit(qt)) - w)
        assert np.all(err <= (np.abs(w) * 2.0**-4 + sinv * 2.0**-10) * (1 + 1e-6))

    def test_e4m3_cast_does_not_saturate(self):
        x = np.array([448, 464, 464.1, 1e6, -1e6], np.float32)  # what to_e4m3's clip is for
        raw = np.asarray(jnp.asarray(x).astype(jnp.float8_e4m3fn).astype(jnp.float32))
        np.testing.assert_array_equal(raw[:2], [448, 448])  # 464: tie, rounds to even 448
        assert np.isnan(raw[2:]).all()
        np.testing.assert_array_equal(x.astype(E4M3).astype(np.float32), raw)  # as ml_dtypes
        np.testing.assert_array_equal(
            fp8.to_e4m3(jnp.asarray(x)).astype(jnp.float32), [448] * 4 + [-448]
        )

    def test_div_rn_is_correctly_rounded(self):
        rng = np.random.default_rng(5)
        a = rng.standard_normal((64, 16)).astype(np.float32)
        d = rng.uniform(0.01, 10, (64, 1)).astype(np.float32)
        np.testing.assert_array_equal(jax.jit(fp8.div_rn)(a, d), a / d)
        np.testing.assert_array_equal(
            jax.jit(lambda a: fp8.div_rn(a, 2688.0))(a), a / np.float32(2688)
        )


# ---- BF16 -------------------------------------------------------------------------------------


class TestBf16:
    def test_dtype_semantics(self):
        w = np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 3, 4)
        qt = quantize_jit(w, Format.BF16)
        assert qt.data.dtype == jnp.bfloat16 and qt.scale is None and qt.global_scale is None
        assert quantize_jit(w, Format.BF16, dtype=None).data.dtype == jnp.float32  # kept
        assert quantize_jit(w, Format.BF16, dtype=jnp.float16).data.dtype == jnp.float16
        assert QTensor.from_float(w).data.dtype == jnp.bfloat16
        np.testing.assert_array_equal(dequantize_jit(quantize_jit(w, Format.BF16, dtype=None)), w)
        chex.assert_type(dequantize_jit(qt, dtype=jnp.bfloat16), jnp.bfloat16)


# ---- QTensor: constructors, take, concat_rows, pytree -----------------------------------------

ALL = [
    (Format.BF16, None),
    (Format.FP8_BLOCK, (4, 8)),
    (Format.NVFP4, None),
    (Format.MXFP4, None),
]


@functools.cache
def make(fmt, block, shape=(4, 8, 64), seed=0) -> QTensor:
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return quantize_jit(w, fmt, block_size=block)


def u8(*shape) -> np.ndarray:
    return np.zeros(shape, np.uint8)


def f(*shape) -> np.ndarray:
    return np.ones(shape, np.float32)


def zeros(fmt, shape, g=1.0) -> QTensor:
    """A zero QTensor built by the constructors (validation only, nothing to compile)."""
    *lead, n, k = shape
    match fmt:
        case Format.NVFP4:
            return QTensor.from_nvfp4_modelopt(u8(*lead, n, k // 2), u8(*lead, n, k // 16), g)
        case Format.MXFP4:
            return QTensor.from_mxfp4(u8(*lead, n, k // 32, 16), u8(*lead, n, k // 32))
        case Format.FP8_BLOCK:
            sinv = f(*lead, -(-n // 4), -(-k // 8))
            return QTensor.from_fp8_block(u8(*lead, n, k), sinv, (4, 8))


class TestConstructors:
    def test_nvfp4_modelopt(self):
        ref = make(Format.NVFP4, None)
        g = ref.global_scale  # [4, 1]
        for scale in (ref.scale, np_(ref.scale)):  # e4m3, or its uint8 bits
            for g2 in (g, g[:, 0]):  # [*L, 1] or [*L]
                qt = QTensor.from_nvfp4_modelopt(np.asarray(ref.data), scale, g2)
                chex.assert_trees_all_equal(qt, ref)
        flat = QTensor.from_nvfp4_modelopt(ref.data[0], ref.scale[0], jnp.float32(0.5))  # scalar
        assert flat.shape == (8, 64) and flat.global_scale.shape == (1,)

    def test_nvfp4_compressed_tensors_inverts_global(self):
        ref = make(Format.NVFP4, None)
        qt = QTensor.from_nvfp4_compressed_tensors(ref.data, ref.scale, 1.0 / ref.global_scale)
        np.testing.assert_allclose(qt.global_scale, ref.global_scale, rtol=2e-7)
        exact = QTensor.from_nvfp4_compressed_tensors(ref.data[0], ref.scale[0], np.float32([4.0]))
        np.testing.assert_array_equal(exact.global_scale, [0.25])
        w = dequantize_jit(QTensor.from_nvfp4_modelopt(ref.data[0], ref.scale[0], np.float32(0.25)))
        np.testing.assert_array_equal(dequantize_jit(exact), w)

    def test_nvfp4_row_segments(self):
        ref = make(Format.NVFP4, None)
        g = np.array([1.0, 2.0], np.float32)  # R = 2: rows 0..3 use 1, rows 4..7 use 2
        qt = QTensor.from_nvfp4_modelopt(ref.data[0], ref.scale[0], g)
        base = QTensor.from_nvfp4_modelopt(ref.data[0], ref.scale[0], 1.0)
        base = np.asarray(dequantize_jit(base))
        np.testing.assert_array_equal(
            dequantize_jit(qt), base * np.array([1, 1, 1, 1, 2, 2, 2, 2])[:, None]
        )

    def test_fp8_block(self):
        ref = make(Format.FP8_BLOCK, (4, 8), shape=(3, 13, 21))
        qt = QTensor.from_fp8_block(np_(ref.data), ref.scale, block_size=(4, 8))
        chex.assert_trees_all_equal(qt, ref)
        bf = QTensor.from_fp8_block(ref.data, ref.scale.astype(jnp.bfloat16), (4, 8))
        assert bf.scale.dtype == jnp.float32
        default = QTensor.from_fp8_block(jnp.zeros((130, 5), jnp.float8_e4m3fn), jnp.ones((2, 1)))
        assert default.block == (128, 128)

    def test_validation_errors(self):
        nv, mx = zeros(Format.NVFP4, (4, 8, 64)), zeros(Format.MXFP4, (4, 8, 64))
        fp8_6 = zeros(Format.FP8_BLOCK, (2, 6, 8))
        nv_8, nv_4 = zeros(Format.NVFP4, (2, 8, 32)), zeros(Format.NVFP4, (2, 4, 32), g=2.0)
        bf, f32 = QTensor.from_float(f(8, 64)), QTensor.from_float(f(8, 64), dtype=None)
        modelopt, ct = QTensor.from_nvfp4_modelopt, QTensor.from_nvfp4_compressed_tensors
        fp8_block = functools.partial(quantize, fmt=Format.FP8_BLOCK)
        cases = [
            # quantize
            (quantize, (f(4, 24), Format.NVFP4), "multiple of the NVFP4 block 16, got K=24"),
            (quantize, (f(4, 48), Format.MXFP4), "multiple of the MXFP4 block 32, got K=48"),
            (quantize, (u8(4, 32), Format.NVFP4), "w: expected dtype.*got uint8"),
            (quantize, (f(32), Format.NVFP4), r"w: expected shape \[..., N, K\], got \(32,\)"),
            (quantize, (f(4, 32), "nvfp4"), "fmt: expected a Format, got 'nvfp4'"),
            (functools.partial(quantize, block_size=(1, 32)), (f(4, 32), Format.NVFP4), "fixed"),
            (functools.partial(fp8_block, block_size=(0, 8)), (f(4, 32),), "block_size"),
            (functools.partial(fp8_block, block_size=128), (f(4, 32),), "block_size"),
            (functools.partial(quantize, dtype=jnp.int8), (f(4, 32), Format.BF16), "dtype: exp"),
            # NVFP4 constructors
            (modelopt, (f(4, 8), u8(4, 1), 1.0), "weight_u8: expected dtype uint8, got float32"),
            (modelopt, (u8(4, 12), u8(4, 1), 1.0), "weight_u8: expected last dim K//2 a multi"),
            (modelopt, (u8(4, 8), u8(4, 2), 1.0), r"_e4m3: expected shape \(4, 1\), got \(4, 2\)"),
            (modelopt, (u8(4, 8), f(4, 1), 1.0), "_e4m3: expected dtype float8_e4m3fn or uint8"),
            (
                modelopt,
                (u8(2, 4, 8), u8(2, 4, 1), f(3)),
                r"_2: expected shape \(\), \(2,\).*\(3,\)",
            ),
            (modelopt, (u8(4, 8), u8(4, 1), f(3)), "R dividing N=4, got"),
            (modelopt, (u8(4, 8), u8(4, 1), np.int32(1)), "weight_scale_2: expected dtype"),
            (ct, (u8(4, 8), u8(4, 1), f(1, 1)), "weight_global_scale: expected shape"),
            (ct, (u8(8), u8(1), 1.0), r"weight_packed: expected shape \[\*L, N, K//2\]"),
            # from_mxfp4
            (QTensor.from_mxfp4, (u8(4, 2, 8), u8(4, 2)), "blocks_u8: expected shape"),
            (QTensor.from_mxfp4, (f(4, 2, 16), u8(4, 2)), "blocks_u8: expected dtype uint8"),
            (QTensor.from_mxfp4, (u8(4, 2, 16), u8(4, 3)), r"scales_u8: expected shape \(4, 2\)"),
            (QTensor.from_mxfp4, (u8(4, 2, 16), f(4, 2)), "scales_u8: expected dtype uint8"),
            # from_fp8_block
            (QTensor.from_fp8_block, (f(4, 8), f(1, 1)), "weight_e4m3: expected dtype"),
            (QTensor.from_fp8_block, (u8(130, 8), f(1, 1)), r"_inv: expected shape \(2, 1\)"),
            (QTensor.from_fp8_block, (u8(4, 8), u8(1, 1)), "weight_scale_inv: expected dtype"),
            (QTensor.from_fp8_block, (u8(4, 8), f(1, 1), (4, -1)), "block_size: expected two"),
            (QTensor.from_fp8_block, (u8(8), f(1)), "weight_e4m3: expected shape"),
            # take / concat_rows / dequantize
            (nv.take, (jnp.array([0]), 1), "axis: expected a leading axis"),
            (nv.take, (jnp.array([0.0]),), "indices: expected an integer dtype"),
            (concat_rows, (nv, mx), "b: expected format Format.NVFP4"),
            (concat_rows, (mx, zeros(Format.MXFP4, (4, 8, 32))), "b: expected shape"),
            (concat_rows, (mx, zeros(Format.MXFP4, (3, 8, 64))), "b: expected shape"),
            (reblock_rows, (fp8_6, 3), "reblock_rows: needs FP8_BLOCK with b0=3 dividing 4"),
            (concat_rows, (nv_8, nv_4), "b: expected 8 rows per global-scale segment"),
            (concat_rows, (bf, f32), "b.data: expected dtype bfloat16"),
            (concat_rows, (mx, f(4, 8, 64)), "b: expected a QTensor"),
            (dequantize, (f(4, 4),), "qt: expected a QTensor"),
        ]
        for fn, args, match in cases:
            with pytest.raises((ValueError, TypeError), match=match):
                fn(*args)


class TestQTensor:
    @pytest.mark.parametrize("fmt,block", ALL)
    def test_take_leading_dims(self, fmt, block):
        qt = make(fmt, block, shape=(2, 3, 8, 64))
        idx = np.array([[2, 0], [1, 1]])
        got = jax.jit(lambda q, i: q.take(i, axis=1))(qt, jnp.asarray(idx))
        assert (got.shape, got.format, got.block) == ((2, 2, 2, 8, 64), fmt, qt.block)
        for leaf, taken in zip(
            jax.tree_util.tree_leaves(qt), jax.tree_util.tree_leaves(got), strict=True
        ):
            np.testing.assert_array_equal(np_(taken), np_(leaf)[:, idx])
        first = qt.take(jnp.array([1]), axis=-4)  # eager, negative axis
        np.testing.assert_array_equal(dequantize_jit(first), np.asarray(dequantize_jit(qt))[[1]])
        out_of_range = qt.take(jnp.array([7]), axis=1)
        assert np.isnan(np.asarray(dequantize(out_of_range))).all()  # mode="fill"

    @pytest.mark.parametrize("fmt,block", ALL)
    def test_concat_rows(self, fmt, block):
        a, b = make(fmt, block, seed=1), make(fmt, block, seed=2)
        c = concat_rows(a, b)
        assert (c.shape, c.format, c.block) == ((4, 16, 64), fmt, a.block)
        want = np.concatenate([dequantize_jit(a), dequantize_jit(b)], axis=-2)
        np.testing.assert_array_equal(dequantize_jit(c), want)
        chex.assert_trees_all_equal(jax.jit(concat_rows)(a, b), c)

    def test_concat_rows_nvfp4_globals(self):
        a, b = make(Format.NVFP4, None, seed=1), make(Format.NVFP4, None, seed=2)
        assert concat_rows(a, b).global_scale.shape == (4, 2)  # different: R = 1 + 1
        shared = QTensor.from_nvfp4_modelopt(b.data, b.scale, a.global_scale)
        assert concat_rows(a, shared).global_scale.shape == (4, 1)  # equal: one segment
        assert jax.jit(concat_rows)(a, shared).global_scale.shape == (4, 2)  # traced: no compare
        ab = concat_rows(a, b)
        abab = concat_rows(ab, ab)  # R = 2 + 2, 8 rows per segment
        assert abab.global_scale.shape == (4, 4)
        want = np.concatenate([dequantize_jit(a), dequantize_jit(b)] * 2, -2)
        np.testing.assert_array_equal(dequantize_jit(abab), want)
        small = QTensor.from_nvfp4_modelopt(a.data[:, :4], a.scale[:, :4], a.global_scale)
        assert concat_rows(a, small).shape == (4, 12, 64)  # one shared segment: any N

    @pytest.mark.parametrize("fmt,block", ALL)
    def test_pytree_and_jit(self, fmt, block):
        qt = make(fmt, block)
        leaves, treedef = jax.tree_util.tree_flatten(qt)
        assert len(leaves) == {Format.BF16: 1, Format.NVFP4: 3}.get(fmt, 2)
        assert qt.nbytes == sum(x.nbytes for x in leaves) and qt.ndim == 3
        doubled = jax.tree_util.tree_map(lambda x: jnp.concatenate([x, x]), qt)
        assert isinstance(doubled, QTensor) and doubled.format == fmt
        chex.assert_trees_all_equal_structs(qt, jax.tree_util.tree_unflatten(treedef, leaves))
        w = jax.jit(lambda q: dequantize(q, dtype=jnp.bfloat16))(qt)
        chex.assert_shape(w, (4, 8, 64))
        chex.assert_type(w, jnp.bfloat16)
        np.testing.assert_array_equal(w, dequantize(qt, dtype=jnp.bfloat16))  # eager

    @pytest.mark.parametrize("fmt,shape", [(Format.NVFP4, (1, 48)), (Format.MXFP4, (5, 32))])
    def test_eager_equals_jit(self, fmt, shape):
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        chex.assert_trees_all_equal(quantize(x, fmt), quantize_jit(x, fmt))

    def test_nbytes(self):
        n = 4 * 8  # rows of [4, 8, 64]
        assert make(Format.NVFP4, None).nbytes == n * 32 + n * 4 + 4 * 4
        assert make(Format.MXFP4, None).nbytes == n * 32 + n * 2
        assert make(Format.BF16, None).nbytes == n * 64 * 2
        assert make(Format.FP8_BLOCK, (4, 8), (3, 13, 21)).nbytes == 3 * 13 * 21 + 3 * 4 * 3 * 4


def test_fp8_concat_rows_reblocks_exactly():
    """Rows of a not a multiple of b0 (6 rows, blocks of 4): re-blocked exactly."""
    rng = np.random.default_rng(5)
    a = quantize(rng.standard_normal((2, 6, 16)).astype(np.float32), Format.FP8_BLOCK,
                 block_size=(4, 8))
    b = quantize(rng.standard_normal((2, 6, 16)).astype(np.float32), Format.FP8_BLOCK,
                 block_size=(4, 8))
    ab = concat_rows(a, b)
    assert ab.block == (2, 8) and ab.shape == (2, 12, 16) and ab.scale.shape == (2, 6, 2)
    np.testing.assert_array_equal(
        dequantize(ab), np.concatenate([dequantize(a), dequantize(b)], axis=-2))
    np.testing.assert_array_equal(dequantize(reblock_rows(a, 1)), dequantize(a))
