"""Tests of pallas_kernels.moe_decode (the expert-major MoE decode kernels) and of moe_forward's
decode variant through them.

The kernels run in Pallas interpret mode on CPU. Interpret mode fills outputs with NaN before
the kernel runs, so "every routed pair finite" doubles as "every row written once". Shapes are
chosen so that N and K are not multiples of the test tiles (H = 160, I = 96 against 64-wide
tiles) and one expert can own more rows than ``block_m`` (T = 33: three row chunks). Routing
patterns are run-time values, so one compile serves all patterns of one (T, format, variant).
A second class lowers every format to Triton IR for an abstract H200 (no GPU needed).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl

import atlas_jax as aj
from atlas_jax.config import Format
from pallas_kernels._device import abstract_gpu
from pallas_kernels.grouped_matmul.config import WeightFormat
from pallas_kernels.moe_decode import (
    DecodeTile,
    ExtraExperts,
    MoEDecodeConfig,
    choose_decode_config,
    combine_reference,
    expected_distinct_experts,
    make_plan,
    moe_decode,
    moe_decode_pairs,
    moe_decode_pairs_reference,
)
from pallas_kernels.moe_decode.kernel import (
    PALLAS_PLAN_MAX_PAIRS,
    RADIX_PLAN_MAX_PAIRS,
    _dense_plan,
    _pallas_plan,
    _pallas_radix_plan,
    _sorted_plan,
    cut_base,
    item_count,
    num_items,
)
from tests.test_moe import make, token_ids_for

E, H, I = 6, 160, 96  # H, I: not multiples of the 64-wide test tiles
FP8_BLOCK = (32, 64)  # small scale blocks: a tile spans several along N
TEST_CONFIG = MoEDecodeConfig(gate_up=DecodeTile(block_n=64, block_k=64),
                              down=DecodeTile(block_n=64, block_k=64))
F16_CONFIG = MoEDecodeConfig(gate_up=DecodeTile(block_n=64, block_k=64, f16_dot=True),
                             down=DecodeTile(block_n=64, block_k=64, f16_dot=True))



@pytest.fixture(scope="module", autouse=True)
def _warm_up_pallas_interpret():
    """The first interpret-mode pallas_call of a process imports modules that add a tracing
    context value, so the first jitted caller would be traced and compiled twice; a trivial
    call first keeps that to one compile per test case."""

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    pl.pallas_call(copy, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), interpret=True)(
        jnp.zeros((8,), jnp.float32))


# ---------------------------------------------------------------------------------------------
# Helpers: routing patterns, weights, tolerances.
# ---------------------------------------------------------------------------------------------


def routing(pattern: str, t: int, k: int, seed: int = 0) -> jax.Array:
    """[T, k] int32 expert ids; ids >= E are zero experts."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(t)])  # k distinct per token
    match pattern:
        case "random":
            pass
        case "repeated":  # every token on the same k experts
            ids = np.tile(np.arange(k)[None, :], (t, 1))
        case "one_expert":  # every token's first slot on expert 3, the others elsewhere
            ids = np.stack([[3, *rng.permutation([e for e in range(E) if e != 3])[:k - 1]]
                            for _ in range(t)])
        case "zero_experts":  # LongCat: ids E, E+1 mixed in
            ids[:, -1] = E + np.arange(t) % 2
            ids[::2, 0] = E + 1
        case "all_zero":
            ids[:] = E
        case "dup_in_token":  # one expert twice in a token (a hash table may do that)
            ids[:, 1] = ids[:, 0]
        case "last_expert":
            ids[:, 0] = E - 1
    return jnp.asarray(ids, jnp.int32)


GPT_OSS = dict(activation="gpt_oss", gate_up_layout="interleaved", limit=0.5)
BF16, FP8, NVFP4, MXFP4 = (WeightFormat.BF16, WeightFormat.FP8_BLOCK, WeightFormat.NVFP4,
                           WeightFormat.MXFP4)
CASES = [  # (T, k, format, variant)
    (1, 4, BF16, dict(x_dtype=jnp.float32)),  # f32 operands and h
    (3, 3, BF16, dict(activation="silu", limit=0.3, bias=True)),  # DeepSeek-V4 clamp
    (33, 2, BF16, dict()),  # an expert with 33 rows: three row chunks
    (3, 2, FP8, dict()),
    (8, 2, FP8, dict(GPT_OSS, bias=True, f16=True)),
    (2, 2, NVFP4, dict(activation="gelu_tanh", bias=True)),
    (33, 2, NVFP4, dict(GPT_OSS, f16=True)),
    (1, 4, MXFP4, dict()),
    (3, 2, MXFP4, dict(GPT_OSS, bias=True, f16=True)),
    # W8A8: e4m3 x e4m3 dots on activations quantized per row per 128 of K (two 64-wide K
    # steps per activation group), both launches or one of them
    (3, 2, FP8, dict(gate_up_act_quant="fp8", down_act_quant="fp8")),
    (8, 2, FP8, dict(GPT_OSS, bias=True, down_act_quant="fp8")),
    (33, 2, FP8, dict(gate_up_act_quant="fp8")),
]
CASE_IDS = [f"T{t}-k{k}-{fmt.value}-" + "-".join(
    f"{n}={getattr(v, '__name__', v)}" for n, v in variant.items() if n != "gate_up_layout")
    for t, k, fmt, variant in CASES]

PATTERNS = ("random", "repeated", "one_expert", "zero_experts", "all_zero", "dup_in_token",
            "last_expert")


def make_weights(rng, fmt: WeightFormat, n: int, k: int, *, global_rows: int = 1,
                 e: int = E, fp8_block: tuple[int, int] = FP8_BLOCK) -> dict:
    """Random (never all-zero) ``[e, n, k]`` weights of one format, drawn with numpy (no XLA
    compiles): the kernel's keyword arrays ``w``, ``scale``, ``global_scale``."""
    match fmt:
        case WeightFormat.BF16:
            w = rng.standard_normal((e, n, k), np.float32) / np.sqrt(k)
            return dict(w=jnp.asarray(w.astype(ml_dtypes.bfloat16)))
        case WeightFormat.FP8_BLOCK:
            w = (64.0 * rng.standard_normal((e, n, k), np.float32)).astype(ml_dtypes.float8_e4m3fn)
            s_shape = (e, -(-n // fp8_block[0]), -(-k // fp8_block[1]))
            s = rng.uniform(0.5, 2.0, s_shape).astype(np.float32) / (64.0 * np.sqrt(k))
            return dict(w=jnp.asarray(w), scale=jnp.asarray(s))
        case WeightFormat.NVFP4:
            w = rng.integers(0, 256, (e, n, k // 2), np.uint8)
            s = rng.uniform(0.25, 4.0, (e, n, k // 16)).astype(ml_dtypes.float8_e4m3fn)
            g = rng.uniform(0.5, 1.5, (e, global_rows)).astype(np.float32) / np.sqrt(k)
            return dict(w=jnp.asarray(w), scale=jnp.asarray(s), global_scale=jnp.asarray(g))
        case WeightFormat.MXFP4:
            w = rng.integers(0, 256, (e, n, k // 2), np.uint8)
            s = rng.integers(122, 126, (e, n, k // 32), np.uint8)
            return dict(w=jnp.asarray(w), scale=jnp.asarray(s))


@functools.cache
def expert_arrays(fmt: WeightFormat, *, bias: bool = False, seed: int = 0,
                  dims: tuple[int, int, int] = (E, H, I),
                  fp8_block: tuple[int, int] = FP8_BLOCK) -> dict:
    """Keyword arrays of both stacks (gate_up with two NVFP4 global-scale row segments);
    ``dims`` = (experts, H, I)."""
    e, h, inter = dims
    rng = np.random.default_rng(seed)
    gu = make_weights(rng, fmt, 2 * inter, h, global_rows=2, e=e, fp8_block=fp8_block)
    dn = make_weights(rng, fmt, h, inter, e=e, fp8_block=fp8_block)
    kw = dict(gate_up=gu.pop("w"), down=dn.pop("w"), fmt=fmt, block_size=fp8_block)
    kw.update({f"gate_up_{name}": v for name, v in gu.items()})
    kw.update({f"down_{name}": v for name, v in dn.items()})
    if bias:
        kw.update(gate_up_bias=jnp.asarray(
                      (0.5 * rng.standard_normal((e, 2 * inter))).astype(ml_dtypes.bfloat16)),
                  down_bias=jnp.asarray(0.5 * rng.standard_normal((e, h)), jnp.float32))
    return kw


def with_spread_mxfp4_scales(arrays: dict, rng, lo: int, hi: int) -> dict:
    """A copy of MXFP4 ``arrays`` whose E8M0 scales are drawn from [lo, hi): blocks of very
    different scales within one K step (the f16 route scales a step by its largest)."""
    arrays = dict(arrays)
    for name in ("gate_up_scale", "down_scale"):
        arrays[name] = jnp.asarray(rng.integers(lo, hi, arrays[name].shape).astype(np.uint8))
    return arrays


def far_apart_case(fmt: WeightFormat, arrays: dict):
    """(x, ids, arrays) of 6 tokens, top-2: rows spanning 1e-4 .. 1e4 and, for MXFP4, E8M0
    scales spread over 2^-50 .. 2^10 (blocks of very different scales within a K step)."""
    t, k = 6, 2
    rng = np.random.default_rng(5)
    hidden = arrays["down"].shape[1]
    x = rng.standard_normal((t, hidden)) * np.logspace(-4, 4, t)[:, None]
    x = jnp.asarray(x.astype(ml_dtypes.bfloat16))
    if fmt is WeightFormat.MXFP4:
        arrays = with_spread_mxfp4_scales(arrays, rng, 77, 138)
    return x, routing("random", t, k, seed=2), arrays


def assert_each_row_close(out, ref, ids, num_experts: int, tol: float = 5e-3):
    """Every routed (token, slot) row within ``tol`` of the reference on its own; zero-expert
    rows exactly 0."""
    out, ref, ids = np.asarray(out), np.asarray(ref), np.asarray(ids)
    assert np.isfinite(out).all()
    for i, j in np.ndindex(ids.shape):
        if not 0 <= ids[i, j] < num_experts:
            np.testing.assert_array_equal(out[i, j], 0.0)
            continue
        assert rel_err(out[i, j], ref[i, j]) < tol, (i, j, rel_err(out[i, j], ref[i, j]))


def make_x(t: int, seed: int = 7, dtype=jnp.bfloat16) -> jax.Array:
    """Rows of very different magnitudes (1e-2 .. 3e2): the f16 route's per-row scaling."""
    rng = np.random.default_rng(seed)
    row_scale = np.logspace(-2, 2.5, t)[:, None] if t > 1 else 1.0
    x = (rng.standard_normal((t, H)) * row_scale).astype(np.float32)
    return jnp.asarray(x.astype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else x)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_pairs_close(out, ref, ids):
    """Kernel pairs vs reference pairs [T, k, H]: finite (written), zero experts exactly 0."""
    chex.assert_equal_shape([out, ref])
    chex.assert_type(out, jnp.float32)
    out, ref = np.asarray(out), np.asarray(ref)
    assert np.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite pair output"
    zero = np.asarray((ids < 0) | (ids >= E))
    np.testing.assert_array_equal(out[zero], 0.0, err_msg="zero-expert pairs must be 0")
    if (~zero).any():
        # Both sides round h to bf16; a rare 1-ulp flip of h moves y by ~2^-8 of one term.
        assert rel_err(out, ref) < 2e-3, rel_err(out, ref)
        np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


ON_GPU = jax.devices()[0].platform == "gpu"
# Interpret mode runs a kernel body through the host backend's compiler: on a GPU that is XLA's,
# whose excess-precision rule drops convert chains (f32 -> e4m3 -> dot operand) inside one
# program (pallas_kernels.grouped_matmul.reference.rounded), so the e4m3 rounding of W8A8
# activations would not happen; the compiled kernels are tested there instead
# (test_compiled_on_gpu_against_reference's fp8-w8a8 cases).
W8A8_INTERPRET_ON_GPU = "W8A8 in interpret mode is checked on CPU (XLA GPU drops e4m3 roundings)"


# ---------------------------------------------------------------------------------------------
# Kernel vs reference.
# ---------------------------------------------------------------------------------------------


class TestKernelInterpret:
    config = TEST_CONFIG

    def check(self, t, k, patterns, *, x_dtype=jnp.bfloat16, config=None, **kw):
        x = make_x(t, dtype=x_dtype)
        for i, pattern in enumerate(patterns):
            ids = routing(pattern, t, k, seed=i)
            out = moe_decode_pairs(x, ids, config=config or self.config, interpret=True, **kw)
            h_dtype = jnp.float32 if x_dtype == jnp.float32 else jnp.bfloat16
            ref = moe_decode_pairs_reference(x, ids, h_dtype=h_dtype, **kw)
            try:
                assert_pairs_close(out, ref, ids)
            except AssertionError as e:
                raise AssertionError(f"routing pattern {pattern!r}: {e}") from None

    # ---- every token count of the issue (1..64, MTP verify 2 and 3), every format, both
    # gate/up layouts and all three activations, biases, f16 dots: a covering set of cases
    # (each case is one compile; every routing pattern runs under it) ----

    @pytest.mark.parametrize("t,k,fmt,variant", CASES, ids=CASE_IDS)
    def test_against_reference(self, t, k, fmt, variant):
        variant = dict(variant)
        if ON_GPU and any(q in variant for q in ("gate_up_act_quant", "down_act_quant")):
            pytest.skip(W8A8_INTERPRET_ON_GPU)
        config = F16_CONFIG if variant.pop("f16", False) else None
        x_dtype = variant.pop("x_dtype", jnp.bfloat16)
        arrays = expert_arrays(fmt, bias=variant.pop("bias", False))
        self.check(t, k, PATTERNS, x_dtype=x_dtype, config=config, **arrays, **variant)

    @pytest.mark.parametrize("fmt", [FP8, NVFP4, MXFP4], ids=["fp8_block", "nvfp4", "mxfp4"])
    def test_f16_rows_scaled_by_their_own_amax(self, fmt):
        """f16 dots scale each activation row by a power of two from its own amax (x's from
        an XLA reduction, h's from gate_up's per-tile amax output): every (token, slot) row
        matches the reference on its own, rows spanning 1e-4 .. 1e4 (a shared or stale amax
        would push the small rows into f16 subnormals or the large ones past f16's range).
        MXFP4: scales spread over 2^-50 .. 2^10 (the f16 route scales each K step by its
        largest, so a step's small blocks fall to f16 subnormals or 0, which must not show)."""
        x, ids, arrays = far_apart_case(fmt, expert_arrays(fmt))
        out = moe_decode_pairs(x, ids, config=F16_CONFIG, interpret=True, **arrays)
        ref = moe_decode_pairs_reference(x, ids, h_dtype=jnp.bfloat16, **arrays)
        assert_each_row_close(out, ref, ids, E)

    # ---- a second expert stack read by the same launches (the shared expert folded in) ----

    @pytest.mark.parametrize("t,fmt,variant", [
        (1, BF16, dict(activation="silu", limit=0.3, bias=True)),
        (3, FP8, dict(f16=True)),
        (8, NVFP4, dict(GPT_OSS, bias=True, f16=True)),
        (2, MXFP4, dict()),
    ], ids=["T1-bf16-bias", "T3-fp8-f16", "T8-nvfp4-gpt_oss-bias-f16", "T2-mxfp4"])
    def test_extra_stack(self, t, fmt, variant):
        """The last two experts of a stack passed as ``extra`` (ids E - 2, E - 1 name them)
        equal the whole stack: routed pairs on both stacks, a shared column (every token on
        expert E - 1, as a folded shared expert), zero experts (ids >= E), and the combine."""
        variant = dict(variant)
        config = F16_CONFIG if variant.pop("f16", False) else TEST_CONFIG
        full = expert_arrays(fmt, bias=variant.pop("bias", False))
        stacks = {n: full[n] for n in full if n not in ("fmt", "block_size")}
        main = {n: (None if a is None else a[:E - 2]) for n, a in stacks.items()}
        extra = ExtraExperts(**{n: (None if a is None else a[E - 2:]) for n, a in stacks.items()})
        x = make_x(t)
        kw = dict(fmt=fmt, block_size=FP8_BLOCK, **variant)
        for i, pattern in enumerate(("random", "last_expert", "zero_experts")):
            ids = routing(pattern, t, 2, seed=i)
            ids = jnp.concatenate([ids, jnp.full((t, 1), E - 1, jnp.int32)], axis=1)
            out = moe_decode_pairs(x, ids, config=config, interpret=True, extra=extra, **main,
                                   **kw)
            ref = moe_decode_pairs_reference(x, ids, h_dtype=jnp.bfloat16, **stacks, **kw)
            try:
                assert_pairs_close(out, ref, ids)
            except AssertionError as e:
                raise AssertionError(f"routing pattern {pattern!r}: {e}") from None
        w = jnp.asarray(np.random.default_rng(1).uniform(size=ids.shape), jnp.float32)
        got = moe_decode(x, ids, w, config=config, interpret=True, extra=extra, **main, **kw)
        want = combine_reference(ref, x, ids, w, E)
        assert rel_err(got, want) < 2e-3, rel_err(got, want)

    def test_extra_stack_must_match(self):
        full = expert_arrays(NVFP4)
        main = dict(gate_up=full["gate_up"][:4], down=full["down"][:4],
                    gate_up_scale=full["gate_up_scale"][:4], down_scale=full["down_scale"][:4],
                    gate_up_global_scale=full["gate_up_global_scale"][:4],
                    down_global_scale=full["down_global_scale"][:4])
        x, ids = make_x(2), routing("random", 2, 2)
        ok = dict(gate_up=full["gate_up"][4:], down=full["down"][4:],
                  gate_up_scale=full["gate_up_scale"][4:], down_scale=full["down_scale"][4:],
                  gate_up_global_scale=full["gate_up_global_scale"][4:],
                  down_global_scale=full["down_global_scale"][4:])
        bad = [
            (dict(ok, down=full["down"][4:, :, :-16]), ValueError, "extra_down: expected shape"),
            (dict(ok, gate_up_global_scale=full["gate_up_global_scale"][4:, :1]), ValueError,
             "row segments"),
            (dict(ok, down_bias=jnp.zeros((2, H), jnp.float32)), ValueError, "one stack only"),
            (dict(ok, gate_up_scale=None), ValueError, "extra_gate_up_scale"),
        ]
        for arrays, err, match in bad:
            with pytest.raises(err, match=match):
                moe_decode_pairs(x, ids, fmt=NVFP4, interpret=True, config=TEST_CONFIG,
                                 extra=ExtraExperts(**arrays), **main)

    # ---- the combine: weighted k-way sum in f32, zero experts as identity ----

    def test_combined_output_with_zero_experts(self):
        arrays = expert_arrays(WeightFormat.BF16)
        x = make_x(5)
        for pattern in ("zero_experts", "all_zero", "random"):
            ids = routing(pattern, 5, 3)
            w = jnp.asarray(np.random.default_rng(3).uniform(size=(5, 3)), jnp.float32)
            out = moe_decode(x, ids, w, config=self.config, interpret=True, **arrays)
            pairs = moe_decode_pairs_reference(x, ids, **arrays)
            ref = combine_reference(pairs, x, ids, w, E)
            chex.assert_shape(out, (5, H))
            assert bool(jnp.all(jnp.isfinite(out)))
            assert rel_err(out, ref) < 2e-3, (pattern, rel_err(out, ref))

    # ---- split-K: K ranges not multiples of each other (H = 160 = 2.5 x 64, I = 96 = 3 x 32),
    # gate_up partials summed and activated between the launches, bias added once ----

    @pytest.mark.parametrize("fmt,variant,config", [
        (BF16, dict(activation="silu", limit=0.3, bias=True), MoEDecodeConfig(
            DecodeTile(block_n=64, block_k=64, split_k=2),
            DecodeTile(block_n=64, block_k=32, split_k=3))),
        (NVFP4, dict(GPT_OSS, bias=True), MoEDecodeConfig(
            DecodeTile(block_n=64, block_k=32, split_k=4, f16_dot=True),
            DecodeTile(block_n=64, block_k=32, split_k=1, f16_dot=True))),
    ], ids=["bf16-silu-clamp-bias-split2x3", "nvfp4-gpt_oss-f16-split4x1"])
    def test_split_k(self, fmt, variant, config):
        variant = dict(variant)
        arrays = expert_arrays(fmt, bias=variant.pop("bias"))
        self.check(3, 2, ("random", "zero_experts", "dup_in_token"), config=config, **arrays,
                   **variant)

    # ---- 1-byte weights of 2^31..2^32 elements: read through their uint16 view (Pallas'
    # Triton lowering would index them with overflowing int32 offsets); the element limit is
    # lowered so that these small stacks take that path ----

    @pytest.mark.parametrize("fmt,variant", [(FP8, dict()), (NVFP4, dict(GPT_OSS, f16=True))],
                             ids=["fp8_block", "nvfp4-gpt_oss-f16"])
    def test_pair_view_of_overflowing_weights(self, fmt, variant, monkeypatch):
        from pallas_kernels import _offsets

        variant = dict(variant)
        config = F16_CONFIG if variant.pop("f16", False) else None
        arrays = expert_arrays(fmt)
        gu = arrays["gate_up"]
        limit = gu.size * 3 // 4  # gate_up over it, its uint16 view (and down) under
        monkeypatch.setattr(_offsets, "INT32_OFFSET_LIMIT", limit)
        jax.clear_caches()
        try:
            assert _offsets.int32_offsets_overflow(gu.shape, gu.dtype)
            self.check(3, 2, ("random", "zero_experts"), config=config, **arrays, **variant)
        finally:
            jax.clear_caches()

    def test_empty_input(self):
        arrays = expert_arrays(WeightFormat.BF16)
        out = moe_decode_pairs(make_x(0), jnp.zeros((0, 2), jnp.int32), interpret=True,
                               config=self.config, **arrays)
        chex.assert_shape(out, (0, 2, H))

    # ---- bad input ----

    def test_bad_inputs_raise(self):
        arrays = expert_arrays(WeightFormat.FP8_BLOCK)
        x, ids = make_x(2), routing("random", 2, 2)
        run = functools.partial(moe_decode_pairs, x, ids, interpret=True, config=self.config)
        with pytest.raises(ValueError, match="block_k to divide the scale block"):
            bad = dict(arrays, block_size=(32, 32))
            bad["gate_up_scale"] = jnp.ones((E, 2 * I // 32, H // 32))
            bad["down_scale"] = jnp.ones((E, H // 32, I // 32))
            run(**bad)
        with pytest.raises(ValueError, match=r"gate_up_scale: expected shape"):
            run(**dict(arrays, gate_up_scale=arrays["gate_up_scale"][:, :1]))
        with pytest.raises(TypeError, match=r"expert_ids: expected an integer dtype"):
            moe_decode_pairs(x, ids.astype(jnp.float32), interpret=True, **arrays)
        with pytest.raises(ValueError, match=r"expert_ids: expected shape \(2, k\)"):
            moe_decode_pairs(x, ids[:1], interpret=True, **arrays)
        with pytest.raises(ValueError, match="only the SiLU and gpt-oss activations clamp"):
            run(activation="gelu_tanh", limit=1.0, **arrays)
        bf16 = expert_arrays(WeightFormat.BF16)
        with pytest.raises(ValueError, match="f16_dot: only for"):
            moe_decode_pairs(x, ids, interpret=True, config=F16_CONFIG, **bf16)
        with pytest.raises(TypeError, match=r"gate_up: expected dtype"):
            moe_decode_pairs(x, ids, interpret=True, **dict(bf16, gate_up=arrays["gate_up"]))
        with pytest.raises(ValueError, match="FP8_BLOCK needs scale_inv"):
            moe_decode_pairs(x, ids, interpret=True, **dict(arrays, down_scale=None))


# ---------------------------------------------------------------------------------------------
# Plan, config, Triton lowering.
# ---------------------------------------------------------------------------------------------


PLAN_BUILDERS = {
    "dense": _dense_plan,
    "sorted": _sorted_plan,
    "pallas": functools.partial(_pallas_plan, interpret=True),
    "radix": functools.partial(_pallas_radix_plan, interpret=True),
}


@pytest.mark.parametrize("builder", list(PLAN_BUILDERS))
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("t,k", [(1, 4), (7, 3), (33, 2), (21, 6)])
def test_plan_covers_every_routed_pair_once(pattern, t, k, builder):
    ids = routing(pattern, t, k)
    plan = jax.jit(PLAN_BUILDERS[builder], static_argnums=1)(ids, E)
    if builder != "dense":  # one plan, whichever way it is built
        dense = jax.jit(_dense_plan, static_argnums=1)(ids, E)
        for name, a, b in zip(plan._fields, plan, dense, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)
    work, tok, row_of_pair, routed = map(np.asarray, plan[:4])
    expert, first, rows = work
    u = min(E, t * k)
    chex.assert_shape([expert, first, rows], (u,))
    flat = np.asarray(ids).reshape(-1)
    real = (flat >= 0) & (flat < E)
    np.testing.assert_array_equal(routed.reshape(-1), real)
    busy = rows > 0
    distinct = np.unique(flat[real])
    np.testing.assert_array_equal(expert[busy], distinct, err_msg="one slot per distinct expert")
    assert not busy[len(distinct):].any() and (expert[~busy] == E).all(), "idle slots last"
    covered = np.zeros(t * k, np.int32)
    for e, r0, n in zip(expert[busy], first[busy], rows[busy], strict=True):
        covered[r0:r0 + n] += 1
        pair_rows = row_of_pair.reshape(-1)
        mine = np.flatnonzero(flat == e)
        np.testing.assert_array_equal(np.sort(pair_rows[mine]), np.arange(r0, r0 + n))
    np.testing.assert_array_equal(covered[:real.sum()], 1, err_msg="routed rows once")
    np.testing.assert_array_equal(covered[real.sum():], 0)
    pair_rows = row_of_pair.reshape(-1)
    np.testing.assert_array_equal(tok[pair_rows], np.arange(t * k) // k)


@pytest.mark.parametrize("item_rows", [1, 3, 5, 8, 13, 16])
def test_num_items_bounds_every_cut(item_rows):
    """``num_items(U, P, r)`` is at least the items ``cut_base`` cuts any ``U`` slots of ``P``
    rows in all into (slots laid out in order, sizes from 0 to past ``r``; aligned cuts,
    ``r`` a multiple of 8, split a slot that crosses one), and the bound is reached."""
    rng = np.random.default_rng(item_rows)
    reached = 0
    for trial in range(3000):
        u = int(rng.integers(1, 24))
        counts = rng.integers(0, int(rng.integers(1, 3 * item_rows + 8)), u)
        if trial == 0:  # slots of one row: P items, the bound
            counts = np.ones(u, np.int64)
        p = int(counts.sum())
        if p == 0:
            continue
        firsts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        cuts = int(sum(item_count(int(f), int(c), item_rows) for f, c in zip(firsts, counts,
                                                                             strict=True)))
        bound = num_items(u, p, item_rows)
        assert cuts <= bound, (u, p, counts)
        reached += cuts == bound
        bases = np.array([cut_base(int(f), item_rows) for f in firsts])
        np.testing.assert_array_equal(firsts - bases, firsts % 8 if item_rows % 8 == 0 else 0)
    assert reached


@pytest.mark.parametrize("item_rows", [1, 5, 8, 16])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("t,k", [(1, 4), (7, 3), (21, 6)])
def test_radix_plan_cuts_the_same_items_as_the_pairwise_plan(pattern, t, k, item_rows):
    """The radix-sort plan program's work items (any item size) equal the pairwise plan
    program's, whose own cut is checked against XLA's cut in test_moe_decode_mosaic.py.
    (126 pairs in items of 1 row: 15-20 s each in interpret mode, so three patterns there.)"""
    if (t, item_rows) == (21, 1) and pattern not in ("random", "one_expert", "zero_experts"):
        pytest.skip("126 one-row items: the other patterns at 126 pairs run with items of 5-16")
    ids = routing(pattern, t, k)
    radix = _pallas_radix_plan(ids, E, interpret=True, item_rows=item_rows)
    pairwise = _pallas_plan(ids, E, interpret=True, item_rows=item_rows)
    for name, a, b in zip(radix._fields, radix, pairwise, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("e,t,k", [(128, 64, 8), (32, 64, 4), (257, 128, 8)])
def test_radix_plan_at_decode_sizes(e, t, k):
    """Qwen3-like 64 tokens x 8 of 128 experts, gpt-oss-like 64 x 4 of 32 and 1024 pairs (the
    bound) of 257 ids (a shared expert past 256): XLA's plan and its item cut."""
    from pallas_kernels.moe_decode.mosaic import ROWS, work_items

    rng = np.random.default_rng(t * k + e)
    ids = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(t)]), jnp.int32)
    plan = jax.jit(functools.partial(make_plan, num_experts=e, pallas=True, interpret=True,
                                     item_rows=ROWS))(ids)
    dense = jax.jit(_dense_plan, static_argnums=1)(ids, e)
    for name, a, b in zip(plan._fields[:4], plan, dense, strict=False):
        np.testing.assert_array_equal(a, b, err_msg=name)
    np.testing.assert_array_equal(plan.items, work_items(dense, e))


def test_radix_plan_refuses_pairs_past_its_counters():
    with pytest.raises(ValueError, match="at most 65535"):
        _pallas_radix_plan(jnp.zeros((8192, 8), jnp.int32), E, interpret=True)


@pytest.mark.parametrize("t,pallas", [(1, True), (4, True), (5, True), (128, True),
                                      (129, True), (4, False)])
def test_make_plan_takes_one_pallas_launch_up_to_its_bound(t, pallas):
    """k = 8: up to 4 tokens (32 pairs) the pairwise program, up to 128 tokens (1024 pairs)
    the radix-sort program, either one launch and no XLA sort; past that, and without
    ``pallas``, XLA alone."""
    k = 8
    ids = jnp.zeros((t, k), jnp.int32)
    jaxpr = str(jax.make_jaxpr(functools.partial(make_plan, num_experts=E, pallas=pallas,
                                                 interpret=True))(ids))
    assert jaxpr.count("pallas_call") == (pallas and t * k <= RADIX_PLAN_MAX_PAIRS)
    assert ("radix" in jaxpr) == (pallas and PALLAS_PLAN_MAX_PAIRS < t * k <= 1024)
    assert ("sort[" in jaxpr) == (t * k > 1024)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled Triton plan launch")
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("t,k", [(1, 6), (5, 6), (6, 6), (21, 6), (64, 8), (170, 6)])
def test_compiled_pallas_plan_on_gpu(pattern, t, k):
    """The compiled plan launches (6 and 30 pairs: the pairwise program; 36, 126, 512 and
    1020: the radix-sort program) give XLA's plan and XLA's cut of its work items."""
    from pallas_kernels.moe_decode.mosaic import ROWS, work_items

    ids = routing(pattern, t, k)
    plan = jax.jit(functools.partial(make_plan, num_experts=E, pallas=True,
                                     item_rows=ROWS))(ids)
    dense = jax.jit(_dense_plan, static_argnums=1)(ids, E)
    for name, a, b in zip(plan._fields[:4], plan, dense, strict=False):
        np.testing.assert_array_equal(a, b, err_msg=name)
    np.testing.assert_array_equal(plan.items, work_items(dense, E))


@pytest.mark.parametrize("t", [1, 4, 5, 64, 128])
def test_pallas_plan_lowers_to_triton_for_h200(t):
    """The plan launch with its work items (8 and 32 pairs: pairwise; 40, 512 and 1024: the
    radix sort), lowered by Pallas' Triton backend for the H200 without a GPU."""
    plan = functools.partial(make_plan, num_experts=128, pallas=True, item_rows=16)
    with abstract_gpu():
        lowered = jax.jit(plan).trace(_SD((t, 8), jnp.int32)).lower(
            lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 1


def test_config_heuristic():
    cfg = choose_decode_config(1, 8, 128, 2048, 768, "bf16", sm_count=132,
                               device_kind="NVIDIA H200")
    assert cfg.gate_up.block_n * 2 <= 128 and cfg.gate_up.swap_ab and cfg.down.block_m == 16
    # 1..3 tokens: tiles stay >= 64 wide (32-wide ones were slower on the H200), unsplit but
    # for one FP4 token's gate_up (on a GPU, with K long enough: 16 steps of 128 here)
    for t in (1, 2, 3):
        for fmt in ("bf16", "fp8_block", "nvfp4", "mxfp4"):
            q = choose_decode_config(t, 8, 128, 2048, 768, fmt, sm_count=132)
            assert q.gate_up.block_n == 64 and q.down.block_n >= 64, (t, fmt)
            split = 4 if t == 1 and fmt in ("nvfp4", "mxfp4") else 1
            assert (q.gate_up.split_k, q.down.split_k) == (split, 1), (t, fmt)
    assert choose_decode_config(1, 8, 128, 2048, 768, "nvfp4").gate_up.split_k == 1  # no GPU
    assert choose_decode_config(1, 8, 128, 896, 768, "nvfp4", sm_count=132).gate_up.split_k == 1
    assert choose_decode_config(1, 4, 128, 2880, 2880, "mxfp4",  # gpt-oss: 180 programs
                                sm_count=132).gate_up.split_k == 1
    # more tokens: BF16 tiles narrow to 32 until the busy programs cover every SM twice
    mid = choose_decode_config(8, 8, 128, 2048, 768, "bf16", sm_count=1000)
    assert mid.gate_up.block_n == 32
    wide = choose_decode_config(64, 8, 128, 2048, 768, "bf16", sm_count=132)
    assert wide.down.block_n >= cfg.down.block_n
    for fmt in WeightFormat:
        gpu = choose_decode_config(8, 8, 256, 7168, 2048, fmt, sm_count=132)
        gpu.check_format(fmt)
        assert gpu.gate_up.f16_dot == (fmt is not WeightFormat.BF16)
        cpu = choose_decode_config(8, 8, 256, 7168, 2048, fmt)
        assert not cpu.gate_up.f16_dot and not cpu.down.f16_dot
    assert expected_distinct_experts(1, 8, 128) == 8
    assert expected_distinct_experts(64, 8, 128) in range(120, 129)
    with pytest.raises(ValueError, match="DecodeTile.block_n"):
        DecodeTile(block_n=24, block_k=64)
    with pytest.raises(ValueError, match="DecodeTile.split_k"):
        DecodeTile(block_n=32, block_k=64, split_k=0)
    with pytest.raises(ValueError, match="DecodeTile.block_k: nvfp4 needs"):
        DecodeTile(block_n=32, block_k=16).check_format("nvfp4")
    # W8A8: e4m3 dots (no f16 route), K steps dividing the activation group of 128
    w8a8 = choose_decode_config(8, 8, 128, 2048, 768, "fp8_block", sm_count=132,
                                gate_up_act_quant="fp8", down_act_quant="fp8")
    for tile in (w8a8.gate_up, w8a8.down):
        assert not tile.f16_dot and 128 % tile.block_k == 0 and tile.block_k >= 32
    assert (w8a8.gate_up.split_k, w8a8.down.split_k) == (1, 1)
    one = choose_decode_config(1, 8, 128, 2048, 768, "fp8_block", sm_count=132,
                               gate_up_act_quant="fp8", down_act_quant="fp8")
    assert (one.gate_up.split_k, one.down.split_k) == (2, 1)  # 96 gate_up programs: split
    assert choose_decode_config(1, 8, 128, 2048, 768, "fp8_block",  # W8A16: not split
                                sm_count=132).gate_up.split_k == 1
    assert choose_decode_config(8, 8, 128, 2048, 768, "fp8_block", sm_count=132,
                                down_act_quant="fp8").gate_up.f16_dot
    with pytest.raises(ValueError, match="W8A8 .* needs FP8_BLOCK"):
        DecodeTile(64, 64).check_format("nvfp4", act_quant="fp8")
    with pytest.raises(ValueError, match="W8A8 needs block_k in"):
        DecodeTile(64, 16).check_format("fp8_block", act_quant="fp8")
    with pytest.raises(ValueError, match="f16_dot: W8A8"):
        DecodeTile(64, 64, f16_dot=True).check_format("fp8_block", act_quant="fp8")


_SD = jax.ShapeDtypeStruct
_LE, _LH, _LI = 16, 576, 160  # ragged against 128-wide tiles (as gpt-oss's 2880)


def _lowering_arrays(fmt: WeightFormat, n: int, k: int, prefix: str) -> dict:
    match fmt:
        case WeightFormat.BF16:
            arrays = dict(w=_SD((_LE, n, k), jnp.bfloat16))
        case WeightFormat.FP8_BLOCK:
            arrays = dict(w=_SD((_LE, n, k), jnp.float8_e4m3fn),
                          scale=_SD((_LE, -(-n // 128), -(-k // 128)), jnp.float32))
        case WeightFormat.NVFP4:
            arrays = dict(w=_SD((_LE, n, k // 2), jnp.uint8),
                          scale=_SD((_LE, n, k // 16), jnp.float8_e4m3fn),
                          global_scale=_SD((_LE, 2), jnp.float32))
        case WeightFormat.MXFP4:
            arrays = dict(w=_SD((_LE, n, k // 2), jnp.uint8),
                          scale=_SD((_LE, n, k // 32), jnp.uint8))
    arrays["bias"] = _SD((_LE, n), jnp.bfloat16)
    return {prefix if name == "w" else f"{prefix}_{name}": v for name, v in arrays.items()}


@pytest.mark.parametrize("fmt,f16,pairs", [(f, False, False) for f in WeightFormat] + [
    (FP8, True, False), (NVFP4, True, False), (MXFP4, True, False), (FP8, True, True),
    (MXFP4, False, True), (MXFP4, True, True), (FP8, "w8a8", False), (FP8, "w8a8", True)])
def test_lowers_to_triton_for_h200(fmt, f16, pairs, monkeypatch):
    arrays = _lowering_arrays(fmt, 2 * _LI, _LH, "gate_up") | _lowering_arrays(
        fmt, _LH, _LI, "down")
    if pairs:  # gate_up over the (lowered) int32-offset limit: read through its uint16 view
        from pallas_kernels import _offsets

        limit = math.prod(arrays["gate_up"].shape) * 3 // 4
        monkeypatch.setattr(_offsets, "INT32_OFFSET_LIMIT", limit)
        jax.clear_caches()
    # N and K ragged in both launches (160 = 2.5 x 64, 576 = 4.5 x 128)
    quant = {}
    if f16 == "w8a8":  # e4m3 x e4m3 dots in both launches
        f16, quant = False, dict(gate_up_act_quant="fp8", down_act_quant="fp8")
    config = MoEDecodeConfig(DecodeTile(64, 128, f16_dot=f16),
                             DecodeTile(128, 128, num_warps=8, f16_dot=f16))

    def f(x, ids, w, arrays):
        return moe_decode(x, ids, w, fmt=fmt, activation="gpt_oss", gate_up_layout="interleaved",
                          config=config, **arrays, **quant)

    with abstract_gpu():
        lowered = jax.jit(f).trace(_SD((8, _LH), jnp.bfloat16), _SD((8, 4), jnp.int32),
                                   _SD((8, 4), jnp.float32), arrays).lower(
                                       lowering_platforms=("cuda",))
    # the plan (32 pairs), gate_up and down launches
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 3
    if pairs:
        jax.clear_caches()  # no trace made under the lowered limit outlives the test


# ---------------------------------------------------------------------------------------------
# moe_forward's decode variant through the kernels.
# ---------------------------------------------------------------------------------------------

_make = jax.jit(make, static_argnames=("name", "fmt", "dtype", "shared_expert_format",
                                       "shared_intermediate_size"))


def moe_tokens(t: int) -> jax.Array:
    """[T, 64] bf16 tokens for tests.test_moe's layer shapes (numpy: no compile)."""
    x = np.random.default_rng(1).standard_normal((t, 64)).astype(ml_dtypes.bfloat16)
    return jnp.asarray(x)
PALLAS_DECODE = aj.KernelConfig(grouped_matmul="pallas", moe_path="decode")
XLA_DECODE = aj.KernelConfig(grouped_matmul="xla", moe_path="decode")
XLA_PREFILL = aj.KernelConfig(grouped_matmul="xla", moe_path="prefill")


@pytest.mark.parametrize("name,fmt,shared_fmt", [
    ("longcat", Format.BF16, None),  # zero experts
    ("gpt_oss", Format.MXFP4, None),  # interleaved, biases, clamped activation
    ("deepseek_v4_hash", Format.BF16, None),  # hash routing
    ("deepseek_v3", Format.NVFP4, Format.BF16),  # shared expert in its own format (kernels)
    ("deepseek_v3", Format.BF16, Format.MXFP4),
    ("qwen2_shared", Format.NVFP4, None),  # gated shared expert
])
def test_moe_forward_decode_equals_prefill_and_xla(name, fmt, shared_fmt):
    p = _make(name=name, fmt=fmt, dtype=jnp.bfloat16, shared_expert_format=shared_fmt)
    x = moe_tokens(9)
    tids = token_ids_for(p, 9)
    f = jax.jit(aj.moe_forward, static_argnames="kernels")  # one jitted decode step
    y = f(p, x, token_ids=tids, kernels=PALLAS_DECODE)
    y_xla = f(p, x, token_ids=tids, kernels=XLA_DECODE)
    y_pre = f(p, x, token_ids=tids, kernels=XLA_PREFILL)
    chex.assert_type(y, jnp.bfloat16)
    chex.assert_tree_all_finite(y)
    assert rel_err(y, y_xla) < 1e-2
    assert rel_err(y, y_pre) < 1e-2


_make_w8a8 = jax.jit(make, static_argnames=("name", "fmt", "dtype", "shared_expert_format",
                                            "gate_up_act_quant", "down_act_quant"))


@pytest.mark.parametrize("name,tokens,quant", [
    ("deepseek_v3", 9, dict(gate_up_act_quant="fp8", down_act_quant="fp8")),  # shared folds
    ("deepseek_v3", 17, dict(down_act_quant="fp8")),  # shared expert on its own (dense)
    ("qwen3", 3, dict(gate_up_act_quant="fp8")),
])
def test_moe_forward_w8a8_every_path(name, tokens, quant):
    """MoEConfig's activation quantization (W8A8) reaches every path of an FP8_BLOCK layer: the
    decode kernels, XLA's decode path, the prefill grouped matmuls (Triton kernel and XLA)
    agree, and all differ from the weight-only (W8A16) layer by the e4m3 rounding of the
    activations (percents), so the fields are not ignored."""
    kw = dict(name=name, fmt=Format.FP8_BLOCK, dtype=jnp.bfloat16,
              shared_expert_format=Format.FP8_BLOCK)
    p = _make_w8a8(**kw, **quant)
    x = moe_tokens(tokens)
    f = jax.jit(aj.moe_forward, static_argnames="kernels")
    y_xla = f(p, x, kernels=XLA_DECODE)
    for kernels in (PALLAS_DECODE, XLA_PREFILL,
                    aj.KernelConfig(grouped_matmul="pallas", moe_path="prefill")):
        y = f(p, x, kernels=kernels)
        chex.assert_tree_all_finite(y)
        # XLA's paths round dequantized FP8 weights to bf16 (transformers' dequantize mode);
        # the kernels scale f32 partials: ~0.4% apart unquantized, more once a differing h
        # is rounded to e4m3
        assert rel_err(y, y_xla) < 2e-2, (kernels, rel_err(y, y_xla))
    w8a16 = f(_make_w8a8(**kw), x, kernels=XLA_DECODE)  # the same path without quantization
    assert 5e-3 < rel_err(y_xla, w8a16) < 0.1, rel_err(y_xla, w8a16)


def test_act_quant_errors():
    """W8A8 on weights that are not FP8_BLOCK, and FP4 activations (no FP4 tensor cores
    here), raise instead of being ignored."""
    p = _make(name="qwen3", fmt=Format.BF16, dtype=jnp.bfloat16)
    x = moe_tokens(2)
    sizes = jnp.asarray([2] + [0] * 7, jnp.int32)
    with pytest.raises(ValueError, match="act_quant=fp8 .* needs FP8_BLOCK"):
        aj.ops.grouped_matmul(x, p.gate_up, sizes, act_quant="fp8")
    with pytest.raises(ValueError, match="act_quant=fp8 .* needs FP8_BLOCK"):
        aj.ops.moe_decode(x, jnp.zeros((2, 1), jnp.int32), p.gate_up, p.down,
                          down_act_quant="fp8")
    p4 = _make(name="qwen3", fmt=Format.NVFP4, dtype=jnp.bfloat16)
    nv = dataclasses.replace(p4, config=dataclasses.replace(p4.config,
                                                            gate_up_act_quant="nvfp4"))
    for kernels in (XLA_DECODE, XLA_PREFILL):
        with pytest.raises(NotImplementedError, match="nvfp4: FP4 activations .*FP4 tensor cores"):
            aj.moe_forward(nv, x, kernels=kernels)


@pytest.mark.parametrize("shared_fmt,tokens,kernels", [
    (Format.NVFP4, 5, True), (Format.MXFP4, 8, True),  # where the kernels measured faster
    (Format.NVFP4, 9, False), (Format.BF16, 5, False), (Format.FP8_BLOCK, 5, False),
])
def test_shared_expert_decode_kernels_equal_dense(shared_fmt, tokens, kernels):
    """The decode variant runs an FP4 shared expert of a few tokens through the Pallas decode
    kernels as a one-expert stack (the traced step has their two launches), else XLA's dense
    path; both give the dense path's result."""
    from atlas_jax.moe.experts import shared_experts

    p = _make(name="qwen2_shared", fmt=Format.BF16, dtype=jnp.bfloat16,
              shared_expert_format=shared_fmt, shared_intermediate_size=64)
    x = moe_tokens(tokens)
    f = jax.jit(shared_experts, static_argnames=("kernels", "decode"))
    y = f(p, x, PALLAS_DECODE, decode=True)
    dense = f(p, x, PALLAS_DECODE, decode=False)
    chex.assert_shape(y, (tokens, 64))
    chex.assert_tree_all_finite(y)
    assert rel_err(y, dense) < 1e-2
    np.testing.assert_array_equal(f(p, x, XLA_DECODE, decode=True), dense)
    jaxpr = str(jax.make_jaxpr(functools.partial(shared_experts, kernels=PALLAS_DECODE,
                                                 decode=True))(p, x))
    assert jaxpr.count("pallas_call") == (3 if kernels else 0)  # plan, gate_up, down


@pytest.mark.parametrize("name,fmt,shared_size,tokens,folds", [
    ("deepseek_v3", Format.NVFP4, None, 9, True),  # shared expert = a routed expert's shapes
    ("qwen2_shared", Format.FP8_BLOCK, 32, 3, True),  # gated shared expert
    ("deepseek_v3", Format.FP8_BLOCK, None, 17, False),  # more than one 16-row chunk
    ("qwen2_shared", Format.NVFP4, 48, 3, False),  # another intermediate size
    ("deepseek_v3", Format.BF16, None, 3, True),  # every format folds
    ("deepseek_v3", Format.MXFP4, None, 1, True),
])
def test_shared_expert_folds_into_routed_launches(name, fmt, shared_size, tokens, folds):
    """A decode step of up to 16 tokens whose shared expert has the routed experts' format
    and shapes reads it in the routed launches (3 Pallas launches in the traced step: the
    plan, gate_up and down; not 6 or an XLA dense path), with the XLA decode path's result.
    (The steps that do not fold run the tests above.)"""
    from atlas_jax.moe.experts import shared_folds

    extra = {} if shared_size is None else dict(shared_intermediate_size=shared_size)
    p = _make(name=name, fmt=fmt, dtype=jnp.bfloat16, **extra)
    assert shared_folds(p, tokens, PALLAS_DECODE) == folds
    assert not shared_folds(p, tokens, XLA_DECODE)
    if not folds:
        return
    x = moe_tokens(tokens)
    f = jax.jit(aj.moe_forward, static_argnames="kernels")
    y = f(p, x, kernels=PALLAS_DECODE)
    chex.assert_tree_all_finite(y)
    assert rel_err(y, f(p, x, kernels=XLA_DECODE)) < 1e-2
    jaxpr = str(jax.make_jaxpr(functools.partial(aj.moe_forward, kernels=PALLAS_DECODE))(p, x))
    assert jaxpr.count("pallas_call") == 3


def test_ops_moe_decode_extra_stack():
    """``ops.moe_decode``'s extra stack: XLA and Pallas agree with running the concatenated
    stack; a mismatched extra stack is a ValueError naming the reason."""
    p = _make(name="deepseek_v3", fmt=Format.MXFP4, dtype=jnp.bfloat16)
    x = moe_tokens(4)
    ids = jnp.asarray(np.array([[0, 8], [8, 3], [7, 9], [8, 8]]), jnp.int32)  # 8: extra, 9: zero
    extra = (p.shared_gate_up.stacked(), p.shared_down.stacked())

    def stack(a, b):  # [E] + [1] -> [E + 1] experts
        cat = lambda u, v: None if u is None else jnp.concatenate([u, v])  # noqa: E731
        return dataclasses.replace(a, data=cat(a.data, b.data), scale=cat(a.scale, b.scale),
                                   global_scale=cat(a.global_scale, b.global_scale),
                                   shape=(a.shape[0] + 1, *a.shape[1:]))

    whole = (stack(p.gate_up, extra[0]), stack(p.down, extra[1]))
    f = jax.jit(aj.ops.moe_decode, static_argnames="kernels")
    got_xla = f(x, ids, p.gate_up, p.down, extra=extra, kernels=XLA_DECODE)
    got_pallas = f(x, ids, p.gate_up, p.down, extra=extra, kernels=PALLAS_DECODE)
    chex.assert_shape(got_xla, (4, 2, 64))
    assert rel_err(got_pallas, got_xla) < 1e-2
    np.testing.assert_array_equal(np.asarray(got_xla)[2, 1], 0.0)  # id 9: a zero expert
    want = f(x, ids, *whole, kernels=XLA_DECODE)
    np.testing.assert_allclose(got_xla, want, rtol=1e-5, atol=1e-5)
    bad = (p.shared_gate_up.stacked(), dataclasses.replace(
        p.shared_down.stacked(), format=Format.FP8_BLOCK))
    with pytest.raises(ValueError, match="extra down is fp8_block"):
        aj.ops.moe_decode(x, ids, p.gate_up, p.down, extra=bad)


def test_ops_moe_decode_auto_and_errors():
    p = _make(name="qwen3")
    x = moe_tokens(3)
    ids = jax.jit(aj.moe.route)(p, x).expert_ids
    f = jax.jit(aj.ops.moe_decode, static_argnames="kernels")
    ref = f(x, ids, p.gate_up, p.down, kernels=aj.KernelConfig(grouped_matmul="xla"))
    auto = f(x, ids, p.gate_up, p.down)  # "auto" off GPU: the xla path
    chex.assert_shape(ref, (3, p.config.top_k, 64))
    np.testing.assert_array_equal(auto, ref)
    with pytest.raises(ValueError, match="expert_ids must be"):
        aj.ops.moe_decode(x, ids[:1], p.gate_up, p.down)
    with pytest.raises(TypeError, match="gate_up must be a QTensor"):
        aj.ops.moe_decode(x, ids, p.gate_up.data, p.down)
    other = dataclasses.replace(p.down, format=Format.FP8_BLOCK)
    with pytest.raises(NotImplementedError, match="gate_up is bf16 but down is fp8_block"):
        aj.ops.moe_decode(x, ids, p.gate_up, other,
                          kernels=aj.KernelConfig(grouped_matmul="pallas"))


def test_deepseek_v3_fp8_stacks_take_the_pair_view():
    """At DeepSeek-V3's FP8 shapes (down [256, 7168, 2048] e4m3 = 3.76e9 bytes: more than 2^31
    elements in at most 2^32 bytes) the down launch reads the stack through its uint16 view;
    the gate_up stack (7.5e9 bytes) is indexed with int64 and stays e4m3. Abstract shapes."""
    sd = jax.ShapeDtypeStruct
    e, h, i = 256, 7168, 2048
    e4m3 = jnp.float8_e4m3fn

    def step(x, ids, w, gu, gs, dn, ds):
        return moe_decode(x, ids, w, gu, dn, fmt="fp8_block", gate_up_scale=gs, down_scale=ds,
                          interpret=True)

    jaxpr = jax.make_jaxpr(step)(
        sd((1, h), jnp.bfloat16), sd((1, 8), jnp.int32), sd((1, 8), jnp.float32),
        sd((e, 2 * i, h), e4m3), sd((e, 2 * i // 128, h // 128), jnp.float32),
        sd((e, h, i), e4m3), sd((e, h // 128, i // 128), jnp.float32))
    def pallas_calls(jx):
        for q in jx.eqns:
            if q.primitive.name == "pallas_call":
                yield q
            for v in q.params.values():
                if hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                    yield from pallas_calls(v.jaxpr)

    calls = [q for q in pallas_calls(jaxpr.jaxpr)
             if "moe_decode_plan" not in str(q.params["name"])]
    weights = [[v.aval for v in q.invars if v.aval.ndim == 4 and v.aval.shape[0] == e][0]
               for q in calls]
    assert [(w.shape, w.dtype) for w in weights] == [
        ((e, 2, i, h), jnp.dtype(e4m3)), ((e, 1, h, i // 2), jnp.dtype(jnp.uint16))]


# ---------------------------------------------------------------------------------------------
# Compiled kernels on a GPU (skipped on CPU): the Triton build with the device's heuristic tiles
# (f16 dots for the quantized formats, the PTX FP4 unpack), several column tiles and row chunks.
# ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled Triton kernels")
@pytest.mark.parametrize("t", [1, 8, 33])
@pytest.mark.parametrize("fmt,variant", [(f, None) for f in WeightFormat] + [
    (MXFP4, "spread"), (FP8, "w8a8"), (FP8, "w8a8-b64")], ids=[f.value for f in WeightFormat] + [
        "mxfp4-spread", "fp8-w8a8", "fp8-w8a8-b64"])
def test_compiled_on_gpu_against_reference(fmt, variant, t):
    """Every (token, slot) row of the compiled kernels matches the reference on its own, rows
    spanning 1e-3 .. 1e3, gpt-oss's clamped activation. ``spread``: MXFP4 scales over 2^-27 ..
    2^8 (the f16 route's per-step largest scale leaves a step's small blocks to f16
    subnormals), under SiLU: the flushed blocks' error is absolute, a fraction of the row's
    pre-activation scale, and a clamp at 7 of pre-activations in the thousands (the 1e3 rows)
    leaves h of magnitude 7 carrying it (5.7% on such a row in interpret mode, against 1e-4
    unclamped). ``w8a8``: e4m3 x e4m3 dots on quantized x and h, 128 x 128 weight blocks
    (128-wide K steps); ``w8a8-b64``: the tests' 32 x 64 blocks (64-wide steps, two per
    activation group)."""
    e, h, inter, k = 16, 1024, 512, 4
    rng = np.random.default_rng(100 * t + list(WeightFormat).index(fmt))
    kw = expert_arrays(fmt, seed=1, dims=(e, h, inter),
                       fp8_block=(128, 128) if variant == "w8a8" else FP8_BLOCK)
    if variant == "spread":
        kw = dict(with_spread_mxfp4_scales(kw, rng, 100, 136), activation="silu")
    else:
        kw = dict(kw, activation="gpt_oss", gate_up_layout="interleaved")
    if variant and variant.startswith("w8a8"):
        kw.update(gate_up_act_quant="fp8", down_act_quant="fp8")
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)])
    ids[0, -1] = e  # a zero expert
    ids = jnp.asarray(ids, jnp.int32)
    x = rng.standard_normal((t, h)) * np.logspace(-3, 3, t)[:, None]
    x = jnp.asarray(x.astype(ml_dtypes.bfloat16))
    out = moe_decode_pairs(x, ids, **kw)
    ref = moe_decode_pairs_reference(x, ids, h_dtype=jnp.bfloat16, **kw)
    assert_each_row_close(out, ref, ids, e)
