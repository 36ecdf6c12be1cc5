"""Tests of pallas_kernels.grouped_matmul: the Pallas kernel against the plain-jnp reference.

The kernel runs in Pallas interpret mode on CPU. Interpret mode fills outputs with NaN before the
kernel runs, so "every element finite" doubles as "every element written" (the poison check);
padding rows past ``sum(group_sizes)`` must come out as exact zeros. A second class lowers every
variant to Triton IR for an abstract H200 (no GPU needed), which catches Pallas-Triton lowering
errors that interpret mode cannot see.
"""

from __future__ import annotations

import functools

import chex
import hypothesis
import hypothesis.strategies as hst
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._device import abstract_gpu, device_sm_count
from pallas_kernels.grouped_matmul.config import (
    Activation,
    ActivationQuant,
    GateUpLayout,
    TileConfig,
    WeightFormat,
    choose_tile_config,
)
from pallas_kernels.grouped_matmul.kernel import (
    _e2m1_to_f32,
    _e8m0_to_f32,
    grouped_matmul,
    make_tile_table,
    max_num_tiles,
)
from pallas_kernels.grouped_matmul.reference import (
    E2M1_VALUES,
    dequantize_weights,
    e2m1_to_f32,
    grouped_matmul_reference,
    quantize_activations_fp8,
)

# Shapes: M, N, K are not multiples of the test tile (16, 32, 64); G = 4.
M, K, N, G = 70, 96, 40, 4
FP8_BLOCK = (32, 64)  # small scale blocks so a tile spans several of them along N
TEST_TILE = TileConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2)

ALL_FORMATS = tuple(WeightFormat)


# ---------------------------------------------------------------------------------------------
# Helpers: data, group patterns, tolerances.
# ---------------------------------------------------------------------------------------------


def make_x(seed: int, m: int = M, k: int = K, dtype=jnp.bfloat16, scale: float = 1.0):
    x = scale * jax.random.normal(jax.random.key(seed), (m, k), jnp.float32)
    return x.astype(dtype)


def make_weights(seed: int, fmt: WeightFormat, g: int, n: int, k: int, *, global_rows: int = 1):
    """Random (never zero) weights of one format: dict of the kernel's keyword arrays + w."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    match fmt:
        case WeightFormat.BF16:
            w = jax.random.normal(k1, (g, n, k), jnp.float32) / np.sqrt(k)
            return dict(w=w.astype(jnp.bfloat16))
        case WeightFormat.FP8_BLOCK:
            w = (64.0 * jax.random.normal(k1, (g, n, k), jnp.float32)).astype(jnp.float8_e4m3fn)
            s_shape = (g, -(-n // FP8_BLOCK[0]), -(-k // FP8_BLOCK[1]))
            s = jax.random.uniform(k2, s_shape, jnp.float32, 0.5, 2.0) / (64.0 * np.sqrt(k))
            return dict(w=w, scale=s)
        case WeightFormat.NVFP4:
            w = jax.random.randint(k1, (g, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
            s = jax.random.uniform(k2, (g, n, k // 16), jnp.float32, 0.25, 4.0)
            gs = jax.random.uniform(k3, (g, global_rows), jnp.float32, 0.5, 1.5) / np.sqrt(k)
            return dict(w=w, scale=s.astype(jnp.float8_e4m3fn), global_scale=gs)
        case WeightFormat.MXFP4:
            w = jax.random.randint(k1, (g, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
            s = jax.random.randint(k2, (g, n, k // 32), 122, 126, jnp.int32).astype(jnp.uint8)
            return dict(w=w, scale=s)


def make_bias(seed: int, g: int, n: int, dtype=jnp.float32):
    return (0.5 * jax.random.normal(jax.random.key(seed), (g, n), jnp.float32)).astype(dtype)


# Group-size patterns over G=4 groups and M=70 rows (runtime values: one compile serves all).
GROUP_PATTERNS = {
    "padding_rows": [17, 5, 30, 3],  # sum 55 < M: rows 55..69 are padding
    "skewed": [1, 61, 2, 6],
    "empty_first_last": [0, 33, 37, 0],
    "empty_middle": [20, 0, 0, 50],
    "all_in_one": [0, 0, M, 0],
    "all_in_last": [0, 0, 0, M],
    "single_rows": [1, 1, 1, 1],  # decode-like, mostly padding
    "all_padding": [0, 0, 0, 0],
    "oversubscribed": [40, 40, 40, 40],  # sum > M: clamped to M (documented)
}


def group_sizes_of(pattern: str) -> jax.Array:
    return jnp.asarray(GROUP_PATTERNS[pattern], jnp.int32)


# Per-dtype tolerances, all in one place: (relative Frobenius error, elementwise rtol, atol as a
# fraction of max |expected|).
TOLERANCES = {
    jnp.dtype(jnp.float32): (2e-5, 1e-4, 1e-5),
    jnp.dtype(jnp.float16): (2e-3, 4e-3, 2e-3),
    jnp.dtype(jnp.bfloat16): (8e-3, 1.6e-2, 8e-3),
}


def assert_close(actual: jax.Array, expected: jax.Array, *, rows_total: int | None = None):
    """Kernel output vs reference; ``rows_total`` checks that padding rows are exactly 0."""
    chex.assert_equal_shape([actual, expected])
    assert bool(jnp.all(jnp.isfinite(actual))), "unwritten (NaN-poisoned) or non-finite output"
    rel_norm, rtol, atol_frac = TOLERANCES[jnp.dtype(actual.dtype)]
    a = np.asarray(actual.astype(jnp.float32))
    e = np.asarray(expected.astype(jnp.float32))
    if rows_total is not None:
        np.testing.assert_array_equal(a[rows_total:], 0.0, err_msg="padding rows not zero")
    denom = max(np.linalg.norm(e), 1e-30)
    err = np.linalg.norm(a - e) / denom
    assert err <= rel_norm, f"relative error {err:.3e} > {rel_norm:.1e}"
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol_frac * max(np.abs(e).max(), 1e-30))


def rows_total(group_sizes: jax.Array, m: int = M) -> int:
    return int(min(int(jnp.maximum(group_sizes, 0).sum()), m))


# ---------------------------------------------------------------------------------------------
# The base class: every format and variant against the reference.
# ---------------------------------------------------------------------------------------------


class GroupedMatmulTestBase:
    """Runs ``impl`` over every weight format and variant; subclasses choose the implementation."""

    tile: TileConfig = TEST_TILE

    def impl(self, x, w, group_sizes, **kwargs):
        raise NotImplementedError

    def check(self, x, weights, patterns, *, out_dtype, impl_kwargs=None, **kwargs):
        """Runs impl and the reference for each group pattern (one compile for all patterns)."""
        weights = dict(weights)
        w = weights.pop("w")
        for pattern in patterns:
            gs = group_sizes_of(pattern)
            out = self.impl(
                x, w, gs, out_dtype=out_dtype, **weights, **kwargs, **(impl_kwargs or {})
            )
            ref = grouped_matmul_reference(x, w, gs, out_dtype=jnp.float32, **weights, **kwargs)
            assert out.dtype == jnp.dtype(out_dtype)
            try:
                assert_close(out, ref, rows_total=rows_total(gs, x.shape[0]))
            except AssertionError as e:
                raise AssertionError(f"group pattern {pattern!r}: {e}") from None

    # ---- plain grouped matmul, every format, bf16 and f32 outputs, every group pattern ----

    @pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
    @pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.value)
    def test_plain(self, fmt, out_dtype):
        weights = make_weights(1, fmt, G, N, K)
        self.check(
            make_x(2), weights, GROUP_PATTERNS, out_dtype=out_dtype, fmt=fmt, block_size=FP8_BLOCK
        )

    @pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.value)
    def test_plain_with_bias(self, fmt):
        weights = make_weights(3, fmt, G, N, K)
        self.check(
            make_x(4),
            weights,
            ["padding_rows", "empty_first_last"],
            out_dtype=jnp.float32,
            fmt=fmt,
            bias=make_bias(5, G, N),
            block_size=FP8_BLOCK,
        )

    def test_f32_activations(self):
        weights = make_weights(6, WeightFormat.BF16, G, N, K)
        self.check(
            make_x(7, dtype=jnp.float32),
            weights,
            ["skewed", "padding_rows"],
            out_dtype=jnp.float32,
            fmt=WeightFormat.BF16,
        )

    def test_nvfp4_global_scale_per_row_segment(self):
        weights = make_weights(8, WeightFormat.NVFP4, G, N, K, global_rows=4)  # R=4 segments
        self.check(
            make_x(9),
            weights,
            ["skewed", "single_rows"],
            out_dtype=jnp.float32,
            fmt=WeightFormat.NVFP4,
        )

    # ---- fused gate_up: every activation and layout (bf16), then each quantized format ----

    @pytest.mark.parametrize("layout", tuple(GateUpLayout), ids=lambda v: v.value)
    @pytest.mark.parametrize("activation", tuple(Activation), ids=lambda v: v.value)
    def test_fused_gate_up_bf16(self, activation, layout):
        weights = make_weights(10, WeightFormat.BF16, G, 2 * N, K)
        self.check(
            make_x(11, scale=4.0),
            weights,
            ["padding_rows", "all_in_one", "skewed"],
            out_dtype=jnp.float32,
            fmt=WeightFormat.BF16,
            activation=activation,
            gate_up_layout=layout,
            bias=make_bias(12, G, 2 * N),
        )

    @pytest.mark.parametrize(
        "fmt,activation,layout,out_dtype",
        [
            (WeightFormat.FP8_BLOCK, Activation.GELU_TANH, GateUpLayout.INTERLEAVED, jnp.float32),
            (WeightFormat.NVFP4, Activation.SILU, GateUpLayout.CONCATENATED, jnp.bfloat16),
            (WeightFormat.MXFP4, Activation.GPT_OSS, GateUpLayout.INTERLEAVED, jnp.float32),
        ],
        ids=["fp8_geglu_interleaved", "nvfp4_swiglu_concat", "mxfp4_gpt_oss_interleaved"],
    )
    def test_fused_gate_up_quantized(self, fmt, activation, layout, out_dtype):
        # NVFP4 with R=2: separate global scales for the gate and up halves (ModelOpt w1/w3).
        weights = make_weights(13, fmt, G, 2 * N, K, global_rows=2)
        bias = make_bias(14, G, 2 * N, jnp.bfloat16) if fmt is WeightFormat.MXFP4 else None
        self.check(
            make_x(15, scale=2.0),
            weights,
            ["empty_first_last", "skewed"],
            out_dtype=out_dtype,
            fmt=fmt,
            activation=activation,
            gate_up_layout=layout,
            bias=bias,
            block_size=FP8_BLOCK,
        )

    # ---- W8A8: fp8 activations (per token per 128 of K) x fp8 block weights ----

    @pytest.mark.parametrize(
        "activation,fp8_dot",
        [(None, False), (Activation.SILU, False), (None, True)],
        ids=["plain", "swiglu", "plain_fp8_dot"],
    )
    def test_w8a8(self, activation, fp8_dot):
        n_w = 2 * N if activation else N
        weights = make_weights(16, WeightFormat.FP8_BLOCK, G, n_w, K)
        self.check(
            make_x(17),
            weights,
            ["padding_rows", "skewed", "all_in_last"],
            out_dtype=jnp.bfloat16,
            fmt=WeightFormat.FP8_BLOCK,
            act_quant=ActivationQuant.FP8,
            activation=activation,
            block_size=FP8_BLOCK,
            impl_kwargs=dict(fp8_dot=fp8_dot),
        )

    def test_w8a8_prequantized_activations(self):
        weights = make_weights(18, WeightFormat.FP8_BLOCK, G, N, K)
        x_q, x_s = quantize_activations_fp8(make_x(19))
        self.check(
            x_q,
            weights,
            ["padding_rows", "empty_middle"],
            out_dtype=jnp.float32,
            fmt=WeightFormat.FP8_BLOCK,
            x_scale=x_s,
            block_size=FP8_BLOCK,
        )

    # ---- unsupported combinations and bad input ----

    @pytest.mark.parametrize(
        "fmt", [WeightFormat.BF16, WeightFormat.NVFP4, WeightFormat.MXFP4], ids=lambda f: f.value
    )
    def test_w8a8_needs_fp8_weights(self, fmt):
        weights = make_weights(20, fmt, G, N, K)
        w = weights.pop("w")
        with pytest.raises(NotImplementedError, match="W8A8"):
            self.impl(
                make_x(21),
                w,
                group_sizes_of("skewed"),
                fmt=fmt,
                act_quant=ActivationQuant.FP8,
                **weights,
            )

    def test_unsupported_dtypes_raise(self):
        weights = make_weights(22, WeightFormat.BF16, G, N, K)
        gs = group_sizes_of("skewed")
        with pytest.raises(NotImplementedError, match="out_dtype"):
            self.impl(make_x(23), weights["w"], gs, fmt="bf16", out_dtype=jnp.int32)
        with pytest.raises(NotImplementedError, match="x: dtype"):
            self.impl(make_x(23).astype(jnp.int8), weights["w"], gs, fmt="bf16")
        x_q, x_s = quantize_activations_fp8(make_x(23))
        with pytest.raises(NotImplementedError, match="W8A8"):
            self.impl(x_q, weights["w"], gs, fmt="bf16", x_scale=x_s)

    def test_bad_inputs_raise(self):
        gs = group_sizes_of("skewed")
        x = make_x(24)
        fp8 = make_weights(25, WeightFormat.FP8_BLOCK, G, N, K)
        nv = make_weights(26, WeightFormat.NVFP4, G, N, K)
        mx = make_weights(27, WeightFormat.MXFP4, G, N, K)
        with pytest.raises(ValueError, match="scale"):  # shape for (128, 128) blocks
            self.impl(x, fp8["w"], gs, fmt="fp8_block", scale=fp8["scale"])
        with pytest.raises(ValueError, match="global_scale"):
            self.impl(
                x, mx["w"], gs, fmt="mxfp4", scale=mx["scale"], global_scale=nv["global_scale"]
            )
        with pytest.raises(ValueError, match="even N"):
            w_odd = make_weights(28, WeightFormat.BF16, G, 2 * N + 1, K)["w"]
            self.impl(x, w_odd, gs, fmt="bf16", activation="silu")
        with pytest.raises(ValueError, match="multiple of 16"):
            self.impl(x[:, :88], nv["w"][..., :44], gs, fmt="nvfp4", scale=nv["scale"][..., :5])
        with pytest.raises(ValueError, match="group_sizes"):
            self.impl(x, nv["w"], gs[:3], fmt="nvfp4", scale=nv["scale"])
        with pytest.raises(TypeError, match="scale"):
            self.impl(x, nv["w"], gs, fmt="nvfp4", scale=nv["scale"].astype(jnp.float32))
        with pytest.raises(ValueError, match="block_k"):  # 64 does not divide a 32-wide block
            self.impl(
                x,
                fp8["w"],
                gs,
                fmt="fp8_block",
                scale=fp8["scale"][:, :, :1].repeat(3, 2),
                block_size=(32, 32),
                tile=TileConfig(16, 32, 64),
            )
        with pytest.raises(ValueError, match="WeightFormat"):
            self.impl(x, fp8["w"], gs, fmt="int4")


class TestPallasInterpret(GroupedMatmulTestBase):
    """The Pallas kernel in interpret mode, ``[block_m, block_n]`` accumulators."""

    def impl(self, x, w, group_sizes, **kwargs):
        kwargs.setdefault("tile", self.tile)
        return grouped_matmul(x, w, group_sizes, interpret=True, **kwargs)


class TestPallasInterpretSwapAB(TestPallasInterpret):
    """The transposed-tile (swap_ab) path; reruns the format-covering subset of the base tests."""

    tile = TileConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2, swap_ab=True)

    @pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.value)
    def test_plain(self, fmt):  # f32 output only
        super().test_plain(fmt, jnp.float32)

    # Covered once by TestPallasInterpret: bias-only, dtype and error paths; the fused epilogue
    # runs here through the quantized-format cases (both layouts, three activations).
    test_plain_with_bias = None
    test_f32_activations = None
    test_w8a8_needs_fp8_weights = None
    test_unsupported_dtypes_raise = None
    test_bad_inputs_raise = None
    test_nvfp4_global_scale_per_row_segment = None
    test_fused_gate_up_bf16 = None
    test_w8a8_prequantized_activations = None


# ---------------------------------------------------------------------------------------------
# Triton lowering for an H200 (abstract device: no GPU needed, nothing runs).
# ---------------------------------------------------------------------------------------------


_LOWER_M, _LOWER_K, _LOWER_N, _LOWER_G = 256, 512, 384, 8


def _lowering_case(fmt, n_w, global_rows=1):
    sd = jax.ShapeDtypeStruct
    g, k = _LOWER_G, _LOWER_K
    match fmt:
        case WeightFormat.BF16:
            return dict(w=sd((g, n_w, k), jnp.bfloat16))
        case WeightFormat.FP8_BLOCK:
            return dict(
                w=sd((g, n_w, k), jnp.float8_e4m3fn),
                scale=sd((g, -(-n_w // 128), k // 128), jnp.float32),
            )
        case WeightFormat.NVFP4:
            return dict(
                w=sd((g, n_w, k // 2), jnp.uint8),
                scale=sd((g, n_w, k // 16), jnp.float8_e4m3fn),
                global_scale=sd((g, global_rows), jnp.float32),
            )
        case WeightFormat.MXFP4:
            return dict(w=sd((g, n_w, k // 2), jnp.uint8), scale=sd((g, n_w, k // 32), jnp.uint8))


LOWERING_VARIANTS = [
    (fmt, dict(), tile)
    for fmt in ALL_FORMATS
    for tile in (TileConfig(64, 128, 64, 4, 3), TileConfig(16, 64, 128, 4, 4, swap_ab=True))
] + [
    (WeightFormat.FP8_BLOCK, dict(act_quant="fp8"), TileConfig(128, 128, 128, 8, 3)),
    (WeightFormat.FP8_BLOCK, dict(act_quant="fp8", fp8_dot=True), TileConfig(128, 128, 128, 8, 3)),
    (
        WeightFormat.FP8_BLOCK,
        dict(act_quant="fp8", activation="silu"),
        TileConfig(16, 64, 128, 4, 4, swap_ab=True),
    ),
    (WeightFormat.BF16, dict(activation="silu"), TileConfig(128, 64, 64, 8, 4)),
    (WeightFormat.NVFP4, dict(activation="gelu_tanh"), TileConfig(64, 64, 128, 4, 3)),
    (
        WeightFormat.MXFP4,
        dict(activation="gpt_oss", gate_up_layout="interleaved", bias=True),
        TileConfig(16, 64, 128, 4, 4, swap_ab=True),
    ),
    (WeightFormat.BF16, dict(out_dtype=jnp.float32), None),  # heuristic tile
]


class TestTritonLowering:
    @pytest.mark.parametrize(
        "fmt,kwargs,tile", LOWERING_VARIANTS, ids=[f"v{i}" for i in range(len(LOWERING_VARIANTS))]
    )
    def test_lowers_for_h200(self, fmt, kwargs, tile):
        kwargs = dict(kwargs)
        fused = "activation" in kwargs
        n_w = 2 * _LOWER_N if fused else _LOWER_N
        arrays = _lowering_case(fmt, n_w, global_rows=2 if fused else 1)
        if kwargs.pop("bias", False):
            arrays["bias"] = jax.ShapeDtypeStruct((_LOWER_G, n_w), jnp.bfloat16)
        w = arrays.pop("w")

        def f(x, w, gs, arrays):
            return grouped_matmul(x, w, gs, fmt=fmt, tile=tile, **arrays, **kwargs)

        x = jax.ShapeDtypeStruct((_LOWER_M, _LOWER_K), jnp.bfloat16)
        gs = jax.ShapeDtypeStruct((_LOWER_G,), jnp.int32)
        with abstract_gpu():
            lowered = jax.jit(f).trace(x, w, gs, arrays).lower(lowering_platforms=("cuda",))
        assert "__gpu$xla.gpu.triton" in lowered.as_text()


# ---------------------------------------------------------------------------------------------
# Work list, config, dequantization helpers.
# ---------------------------------------------------------------------------------------------


def _check_tile_table(sizes: list[int], m: int, block_m: int):
    num_tiles = max_num_tiles(m, len(sizes), block_m)
    table = np.asarray(
        _tile_table_jit(jnp.asarray(sizes, jnp.int32), m=m, block_m=block_m, num_tiles=num_tiles)
    )
    seg, start, end = table
    ends = np.minimum(np.cumsum(np.maximum(sizes, 0)), m)
    bounds = np.concatenate([[0], ends, [m]])
    covered = np.zeros(m, np.int32)
    for s, r0, r1 in zip(seg, start, end, strict=True):
        if s == len(sizes) + 1:  # idle
            assert r0 == r1 == m
            continue
        assert bounds[s] <= r0 < r1 <= bounds[s + 1], (s, r0, r1)
        assert r1 == bounds[s + 1], "tile end must be its segment's end"
        covered[r0 : min(r0 + block_m, r1)] += 1
    np.testing.assert_array_equal(covered, 1, err_msg="every row in exactly one tile")
    active = seg <= len(sizes)
    assert np.all(np.diff(active.astype(np.int32)) <= 0), "idle entries must come last"


@functools.partial(jax.jit, static_argnames=("m", "block_m", "num_tiles"))
def _tile_table_jit(sizes, *, m, block_m, num_tiles):
    return make_tile_table(sizes, num_rows=m, block_m=block_m, num_tiles=num_tiles)


# Few distinct shapes (each is one compile); the sizes themselves vary freely.
@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    sizes=hst.lists(hst.integers(0, 40), min_size=3, max_size=3)
    | hst.lists(hst.integers(0, 12), min_size=8, max_size=8),
    m=hst.sampled_from([1, 9, 64, 150]),
    block_m=hst.sampled_from([16, 64]),
)
def test_tile_table_covers_every_row_once(sizes, m, block_m):
    _check_tile_table(sizes, m, block_m)


def test_tile_table_edge_cases():
    _check_tile_table([0, 0, 0], 5, 16)  # all padding
    _check_tile_table([5], 5, 16)  # one group, one partial tile
    _check_tile_table([1] * 8, 8, 16)  # bound min(M, ...) is tight
    _check_tile_table([16, 16], 32, 16)  # exact multiples, no padding
    _check_tile_table([-3, 10], 12, 16)  # negative size counts as 0


def test_e2m1_decode_matches_table():
    codes = jnp.arange(16, dtype=jnp.int32)
    expected = np.array([*E2M1_VALUES, *(-v for v in E2M1_VALUES)], np.float32)
    np.testing.assert_array_equal(np.asarray(e2m1_to_f32(codes)), expected)
    np.testing.assert_array_equal(np.asarray(_e2m1_to_f32(codes)), expected)
    bits = jnp.arange(1, 255, dtype=jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(_e8m0_to_f32(bits)), np.exp2(np.arange(1, 255) - 127.0).astype(np.float32)
    )


def test_dequantize_nvfp4_nibble_order():
    # byte 0x21: low nibble 1 (0.5) is k=0, high nibble 2 (1.0) is k=1.
    w = jnp.full((1, 1, 8), 0x21, jnp.uint8)
    s = jnp.ones((1, 1, 1), jnp.float8_e4m3fn)
    deq = dequantize_weights(w, "nvfp4", scale=s, global_scale=jnp.full((1, 1), 2.0))
    np.testing.assert_array_equal(np.asarray(deq[0, 0, :2]), [1.0, 2.0])


class TestTileConfig:
    def test_validates(self):
        for bad in (dict(block_m=24), dict(block_n=8), dict(block_k=1024)):
            args = dict(block_m=64, block_n=64, block_k=64) | bad
            with pytest.raises(ValueError, match="TileConfig"):
                TileConfig(**args)
        with pytest.raises(ValueError, match="num_warps"):
            TileConfig(64, 64, 64, num_warps=3)
        with pytest.raises(ValueError, match="num_stages"):
            TileConfig(64, 64, 64, num_stages=0)
        with pytest.raises(ValueError, match="MXFP4"):
            TileConfig(64, 64, 16).check_format(WeightFormat.MXFP4)
        with pytest.raises(ValueError, match="W8A8"):
            TileConfig(64, 64, 16).check_format("fp8_block", act_quant="fp8")
        hash(TileConfig(64, 64, 64))  # usable as a jit static argument

    @pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.value)
    @pytest.mark.parametrize("fused", [False, True])
    def test_heuristic_gives_valid_tiles(self, fmt, fused):
        for m, g in [(1, 8), (8, 128), (64, 128), (4096, 128), (65536, 256), (300, 4)]:
            for sm in (None, 16, 132):
                for kind in (None, "NVIDIA H200", "NVIDIA GB10"):
                    aq = "fp8" if fmt is WeightFormat.FP8_BLOCK and m > 64 else "none"
                    t = choose_tile_config(
                        m,
                        768,
                        2048,
                        g,
                        fmt,
                        fused_gate_up=fused,
                        act_quant=aq,
                        sm_count=sm,
                        device_kind=kind,
                    )
                    t.check_format(fmt, act_quant=aq)
                    assert t == choose_tile_config(
                        m,
                        768,
                        2048,
                        g,
                        fmt,
                        fused_gate_up=fused,
                        act_quant=aq,
                        sm_count=sm,
                        device_kind=kind,
                    )

    def test_heuristic_shapes(self):
        decode = choose_tile_config(8, 768, 2048, 128, "nvfp4", sm_count=132)
        prefill = choose_tile_config(65536, 768, 2048, 128, "nvfp4", sm_count=132)
        assert decode.block_m == 16 and decode.swap_ab
        assert prefill.block_m == 128 and not prefill.swap_ab
        # Fewer SMs never asks for narrower N tiles.
        few = choose_tile_config(8, 768, 2048, 128, "bf16", sm_count=8)
        many = choose_tile_config(8, 768, 2048, 128, "bf16", sm_count=264)
        assert few.block_n >= many.block_n

    def test_sm_count_is_queried(self):
        sm = device_sm_count()
        if jax.devices()[0].platform == "gpu":
            assert isinstance(sm, int) and sm > 0
        else:
            assert sm is None


def test_tuned_store_round_trip(tmp_path):
    from pallas_kernels.grouped_matmul.tuned import store, tuned_key, tuned_tile_config

    path = tmp_path / "tuned.json"
    key = tuned_key(4096 * 8, 1536, 2048, 128, "nvfp4", fused_gate_up=False)
    assert key == "nvfp4|none|plain|n1536|k2048|rpg256"
    assert tuned_tile_config("NVIDIA H200", key, path) is None
    tile = TileConfig(128, 256, 64, 8, 3)
    store("NVIDIA H200", {key: tile}, path)
    assert tuned_tile_config("NVIDIA H200", key, path) == tile
    assert tuned_tile_config("NVIDIA H100", key, path) is None
    assert tuned_tile_config(None, key, path) is None
