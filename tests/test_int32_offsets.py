"""Operands too large for the int32 offsets of Pallas' Triton lowering (pallas_kernels._offsets).

The bug is GPU-only (a 1-byte operand with more than 2**31 elements but at most 2**32 bytes is
indexed with int32 offsets that wrap: silently wrong loads; it made the EP=2 DeepSeek-V3 forward
wrong on 2 x H200). On CPU: (1) the grouped matmul traced at the real shapes, abstractly, hands
no overflowing operand to pallas_call; (2) the uint16 "pair view" that avoids it, forced on small
shapes, gives the same numbers in interpret mode and lowers to Triton for an H200; (3) an
overflowing operand that has no pair view raises.
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _offsets
from pallas_kernels._device import abstract_gpu
from pallas_kernels.grouped_matmul import kernel
from pallas_kernels.grouped_matmul.config import TileConfig, WeightFormat
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference
from tests.test_grouped_matmul_kernel import make_weights, make_x

SD = jax.ShapeDtypeStruct
E4M3, U8 = jnp.float8_e4m3fn, jnp.uint8
QUANTIZED = (WeightFormat.FP8_BLOCK, WeightFormat.NVFP4, WeightFormat.MXFP4)


def test_overflow_predicate_at_deepseek_v3_shapes():
    ov = _offsets.int32_offsets_overflow
    assert ov((128, 4096, 7168), E4M3)  # EP=2 shard of the FP8 gate_up: 3.8e9 bytes, int32
    assert ov((256, 4096, 3584), U8)  # one-GPU NVFP4 gate_up (packed)
    assert not ov((256, 4096, 7168), E4M3)  # 7.5e9 bytes: the lowering uses int64
    assert not ov((128, 7168, 2048), E4M3)  # EP=2 down: 1.9e9 elements
    assert not ov((128, 4096, 7168), jnp.bfloat16)  # 2-byte: int64 from 2**31 elements on
    assert not ov((2**31,), U8) and ov((2**31 + 1,), U8) and ov((2**32,), U8)


def _pallas_operands(fn, *args) -> list:
    """Avals of every operand of every pallas_call in ``fn``'s jaxpr (abstract: no memory)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.extend(v.aval for v in eqn.invars)
            for v in eqn.params.values():
                for sub in v if isinstance(v, tuple) else (v,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    assert found, "no pallas_call traced"
    return found


def _weights_sd(fmt: WeightFormat, g: int, n: int, k: int) -> dict:
    match fmt:
        case WeightFormat.FP8_BLOCK:
            return dict(w=SD((g, n, k), E4M3), scale=SD((g, n // 128, k // 128), jnp.float32))
        case WeightFormat.NVFP4:
            return dict(w=SD((g, n, k // 2), U8), scale=SD((g, n, k // 16), E4M3),
                        global_scale=SD((g, 1), jnp.float32))
        case WeightFormat.MXFP4:
            return dict(w=SD((g, n, k // 2), U8), scale=SD((g, n, k // 32), U8))


@pytest.mark.parametrize(
    "fmt,g,n,k,activation",
    [
        (WeightFormat.FP8_BLOCK, 128, 4096, 7168, "silu"),  # DeepSeek-V3 EP=2 gate_up (the bug)
        (WeightFormat.NVFP4, 256, 4096, 7168, "silu"),  # DeepSeek-V3 one-GPU gate_up, NVFP4
        (WeightFormat.MXFP4, 256, 7168, 4096, None),  # K/2 = 2048 packed bytes per row
    ],
    ids=["fp8_ep2_gate_up", "nvfp4_gate_up", "mxfp4_down"],
)
def test_no_overflowing_operand_at_real_shapes(fmt, g, n, k, activation):
    arrays = _weights_sd(fmt, g, n, k)
    w = arrays.pop("w")
    assert _offsets.int32_offsets_overflow(w.shape, w.dtype)  # the case under test

    def f(x, w, gs, arrays):
        return kernel.grouped_matmul(x, w, gs, fmt=fmt, activation=activation, **arrays)

    avals = _pallas_operands(f, SD((2048, k), jnp.bfloat16), w, SD((g,), jnp.int32), arrays)
    bad = [a for a in avals if _offsets.int32_offsets_overflow(a.shape, a.dtype)]
    assert not bad, f"pallas_call operands indexed with overflowing int32 offsets: {bad}"
    assert any(a.dtype == jnp.uint16 for a in avals)  # the weight went through the pair view


def test_overflowing_operand_without_pair_view_raises():
    m, k = 2**31 // 7168 + 1, 7168  # a pre-quantized e4m3 x just past 2**31 elements
    w = _weights_sd(WeightFormat.FP8_BLOCK, 4, 256, k)

    def f(x, x_scale, w):
        return kernel.grouped_matmul(x, w.pop("w"), jnp.zeros((4,), jnp.int32), fmt="fp8_block",
                                     x_scale=x_scale, **w)

    with pytest.raises(NotImplementedError, match="x: shape .* int32 offsets"):
        jax.make_jaxpr(f)(SD((m, k), E4M3), SD((m, k // 128), jnp.float32), w)


@pytest.fixture
def force_pair_view(monkeypatch):
    """Lower the element limit so that small test weights take the pair view (their x, scales
    and outputs stay under it); fresh traces on both sides."""

    def force(limit: int):
        monkeypatch.setattr(_offsets, "INT32_OFFSET_LIMIT", limit)
        jax.clear_caches()

    yield force
    jax.clear_caches()


M, N, K, G = 20, 40, 96, 3  # N, K not multiples of the tile (K ragged for block_k 64)
TILE = TileConfig(32, 64, 64, 4, 2)


@pytest.mark.parametrize(
    "fmt,activation",
    [(WeightFormat.FP8_BLOCK, "silu"), (WeightFormat.NVFP4, None)],  # MXFP4: NVFP4's load path
    ids=["fp8_block_swiglu", "nvfp4"],
)
def test_pair_view_matches_reference_interpret(fmt, activation, force_pair_view):
    n_w = 2 * N if activation else N
    weights = make_weights(21, fmt, G, n_w, K, global_rows=1)
    w = weights.pop("w")
    if fmt is WeightFormat.FP8_BLOCK:
        weights["block_size"] = (32, 64)
    x = make_x(22, M, K)
    gs = jnp.asarray([7, 0, 9], jnp.int32)  # an empty group, 4 padding rows
    force_pair_view(w.size * 3 // 4)  # w over the limit, its uint16 view (w.size / 2) under
    assert _offsets.int32_offsets_overflow(w.shape, w.dtype)
    out = kernel.grouped_matmul(x, w, gs, fmt=fmt, activation=activation, tile=TILE,
                                interpret=True, out_dtype=jnp.float32, **weights)
    ref = grouped_matmul_reference(x, w, gs, fmt=fmt, activation=activation,
                                   out_dtype=jnp.float32, **weights)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4,
                               atol=1e-5 * float(jnp.abs(ref).max()))
    np.testing.assert_array_equal(np.asarray(out)[16:], 0.0)  # padding rows


@pytest.mark.parametrize("fmt", QUANTIZED, ids=lambda f: f.value)
def test_pair_view_lowers_for_h200(fmt, force_pair_view):
    arrays = _weights_sd(fmt, 8, 256, 512)
    w = arrays.pop("w")
    force_pair_view(w.shape[0] * w.shape[1] * w.shape[2] - 1)

    def f(x, w, gs, arrays):
        return kernel.grouped_matmul(x, w, gs, fmt=fmt, tile=TileConfig(64, 128, 64, 4, 3),
                                     activation="silu", **arrays)

    x, gs = SD((64, 512), jnp.bfloat16), SD((8,), jnp.int32)
    with abstract_gpu():
        lowered = jax.jit(f).trace(x, w, gs, arrays).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


def test_paged_attention_kernels_read_overflowing_caches_through_the_pair_view():
    """Both paged-attention kernels take FP8 pages of 2^31..2^32 elements through their uint16
    view: no overflowing operand reaches the pallas_call (abstract shapes: nothing that size is
    allocated); the same cache one size class up or down goes in as it is."""
    from pallas_kernels.paged_attention import paged_decode, paged_prefill

    def operands(attend, pages):
        shape = (pages, 16, 8, 128)
        kv, sc = SD(shape, E4M3), SD(shape[:3], jnp.float32)
        q = SD((1, 1, 32, 128), jnp.bfloat16)
        pos = SD((1,), jnp.int32) if attend is paged_decode else SD((1, 1), jnp.int32)
        return _pallas_operands(
            lambda q, k, v, ks, vs, p: attend(q, k, v, jnp.zeros((1, 4), jnp.int32), p,
                                              kv_dtype="fp8", k_scale=ks, v_scale=vs,
                                              scale=0.1, interpret=True),
            q, kv, kv, sc, sc, pos)

    for attend in (paged_decode, paged_prefill):
        avals = operands(attend, 150_000)  # 2.46e9 one-byte elements
        assert not [a for a in avals if _offsets.int32_offsets_overflow(a.shape, a.dtype)]
        assert sum(a.dtype == jnp.uint16 for a in avals) == 2  # k and v pages
        for pages in (120_000, 300_000):  # 1.97e9 elements; 4.9e9 bytes (int64 offsets)
            assert not any(a.dtype == jnp.uint16 for a in operands(attend, pages))


@pytest.mark.parametrize("kv_dtype", ["fp8", "nvfp4"])
@pytest.mark.parametrize("kernel_name", ["decode", "prefill"])
def test_paged_pair_view_gives_the_same_output(kernel_name, kv_dtype, force_pair_view):
    """Forced on a small cache, the pair view changes nothing: the kernel's output equals the
    plain pages' bit for bit (interpret mode; scattered pages, ragged lengths, GQA)."""
    from pallas_kernels.paged_attention import (
        DecodeConfig,
        KVDtype,
        PrefillConfig,
        paged_decode,
        paged_prefill,
    )
    from tests import test_paged_attention_kernel as dec
    from tests import test_paged_prefill_kernel as pre

    kv = KVDtype(kv_dtype)
    if kernel_name == "decode":
        args, kw = dec.make_case(3, kv, q_len=2, group=4, d=64, window=None, sinks=False)
        call = functools.partial(paged_decode, *args, **kw, config=DecodeConfig(2, 2),
                                 out_dtype=jnp.float32, interpret=True)
    else:
        args, kw = pre.make_case(3, kv, q_pos=pre.contiguous_q_pos(), group=4, d=64)
        call = functools.partial(paged_prefill, *args, **kw, config=PrefillConfig(4, 2),
                                 out_dtype=jnp.float32, interpret=True)
    plain = np.asarray(call())
    pages = args[1]
    force_pair_view(pages.size - 1)  # k and v pages over the limit; their scales under it
    assert _offsets.int32_offsets_overflow(pages.shape, pages.dtype)
    np.testing.assert_array_equal(np.asarray(call()), plain)


@pytest.mark.parametrize("kv_dtype", ["fp8", "nvfp4"])
@pytest.mark.parametrize("kernel_name", ["decode", "prefill"])
def test_paged_pair_view_lowers_for_h200(kernel_name, kv_dtype, force_pair_view):
    from pallas_kernels.paged_attention import (
        DecodeConfig,
        PrefillConfig,
        paged_decode,
        paged_prefill,
    )

    n, p, hk, d = 64, 16, 4, 128
    d_store = d if kv_dtype == "fp8" else d // 2
    pages = SD((n, p, hk, d_store), E4M3 if kv_dtype == "fp8" else U8)
    scales = dict(k_scale=SD((n, p, hk), jnp.float32), v_scale=SD((n, p, hk), jnp.float32))
    if kv_dtype == "nvfp4":
        scales = {f"{w}_{name}": SD((n, p, hk, *shape), dtype) for w in "kv" for name, shape, dtype
                  in (("scale", (d // 16,), E4M3), ("global_scale", (), jnp.float32))}
    force_pair_view(n * p * hk * d_store - 1)
    if kernel_name == "decode":
        attend, q, pos = paged_decode, SD((2, 1, 32, d), jnp.bfloat16), SD((2,), jnp.int32)
        config = DecodeConfig(4, 2)
    else:
        attend, q, pos = paged_prefill, SD((2, 8, 32, d), jnp.bfloat16), SD((2, 8), jnp.int32)
        config = PrefillConfig(8, 2)

    def f(q, k, v, tables, pos, scales):
        return attend(q, k, v, tables, pos, kv_dtype=kv_dtype, scale=0.1, config=config,
                      **scales)

    with abstract_gpu():
        lowered = jax.jit(f).trace(q, pages, pages, SD((2, 8), jnp.int32), pos, scales).lower(
            lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "__gpu$xla.gpu.triton" in text and "ui16" in text
