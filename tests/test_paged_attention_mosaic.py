"""Tests of the Mosaic GPU FP8 paged-decode kernel (``pallas_kernels/paged_attention/mosaic.py``).

On any machine: the token order of the O^T dot (a permutation, conflict-free V loads), the
two-term e4m3 queries, the support checks, and the lowering of the kernel for sm_90 (Mosaic GPU
layout inference and the module build; no GPU needed). On a GPU: the compiled kernel against the
plain-jnp reference with the paged-attention tests' cases (ragged lengths, scattered pages,
NaN poison in every cell no query may read, Q = 1..4, window, sinks, several splits).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._device import abstract_gpu
from pallas_kernels.paged_attention.config import FULL_WAVE, KVDtype, wave_splits
from pallas_kernels.paged_attention.mosaic import (
    MAX_ROWS,
    P_SHIFT,
    RESIDENT_PROGRAMS,
    T,
    choose_splits,
    k_of_token,
    paged_decode_mosaic,
    query_terms,
    token_of_k,
    unsupported_reason,
)
from pallas_kernels.paged_attention.reference import paged_decode_reference
from tests.test_paged_attention_kernel import GPU_GEO, Geometry, make_case

ON_GPU = jax.devices()[0].platform == "gpu"
TOL = 3e-3  # e4m3 hi + lo terms of q and of the probabilities: ~8 significant bits each


def test_token_order_is_a_permutation_with_conflict_free_loads():
    k = np.arange(T)
    tok = token_of_k(k)
    assert sorted(tok) == list(range(T))
    np.testing.assert_array_equal(k_of_token(tok), k)
    # one V load instruction: quad lane c loads token 16 kb + 8 (e // 2) + 2c + e % 2 for a
    # fixed (kb, e); the 128-byte swizzle XORs the 16-byte chunk with t % 8: distinct, one parity
    for kb in range(4):
        for e in range(4):
            ts = [token_of_k(16 * kb + 4 * c + e) for c in range(4)]
            assert len({t % 8 for t in ts}) == 4 and len({t % 2 for t in ts}) == 1


def test_query_terms_reconstruct_the_queries():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 8, 128)) * np.logspace(-3, 3, 8)[None, None, :, None]
    q = jnp.asarray(q, jnp.bfloat16)
    qcat, qinv = query_terms(q, group=4, rows_pad=16, scale=0.1)
    assert qcat.shape == (2, 2, 32, 128) and qcat.dtype == jnp.float8_e4m3fn
    hi, lo = qcat[:, :, :16].astype(jnp.float32), qcat[:, :, 16:].astype(jnp.float32)
    x = q.astype(jnp.float32).reshape(2, 3, 2, 4, 128).transpose(0, 2, 1, 3, 4)
    x = x.reshape(2, 2, 12, 128)
    back = (hi + lo)[:, :, :12] * (qinv[:, :, :12, None] / (0.1 * np.log2(np.e)))
    err = np.abs(np.asarray(back - x)).max(axis=-1) / np.abs(np.asarray(x)).max(axis=-1)
    assert err.max() < 2.0**-8
    assert np.all(np.asarray(hi[:, :, 12:]) == 0) and np.all(np.asarray(lo[:, :, 12:]) == 0)


def test_unsupported_reasons():
    assert unsupported_reason("fp8", 128, 16, 8, None) is None
    assert "FP8" in unsupported_reason("bf16", 128, 16, 8, None)
    assert "head_dim 64" in unsupported_reason("fp8", 64, 16, 8, None)
    assert "page_size 128" in unsupported_reason("fp8", 128, 128, 8, None)
    assert "query rows" in unsupported_reason("fp8", 128, 16, MAX_ROWS + 1, None)
    assert "softcap" in unsupported_reason(KVDtype.FP8, 128, 16, 8, 30.0)


@pytest.mark.parametrize("batch,hk,ctx,want", [
    (32, 4, 16384, 2), (8, 4, 16384, 8), (1, 4, 32768, 66), (32, 8, 16384, 1),
    (64, 4, 16384, 1), (32, 8, 4096, 1), (24, 8, 16384, 2), (20, 8, 16384, 2),
    (128, 4, 4096, 1), (32, 4, 4096, 2), (1, 4, 512, 2), (2, 1, 64, 1)])
def test_choose_splits_fills_whole_waves(batch, hk, ctx, want):
    """Splits up to ~2 programs an SM, each >= 4 steps, at the count whose last wave of
    ``RESIDENT_PROGRAMS`` an SM is fullest: B 32 4 kv heads take 2 (256 programs: one wave on
    132 SMs), not the 3 that made 384 (1.45 waves, 26-34% slower on an H100, NOTES session 38);
    B 8 takes 8, not 9. Tied counts: 256 programs (a wave 0.97 full at 1 split or 2) take 1
    (19-22% faster on an H100 at R 8, NOTES session 39), 192 / 160 (0.73 / 0.61) take 2 (1
    split 15% / 27% slower)."""
    sms, page = 132, 16
    got = choose_splits(batch, hk, ctx // page, page, sms)
    assert got == want
    steps, programs, slots = ctx // T, batch * hk, RESIDENT_PROGRAMS * sms
    assert got >= 1 and (got == 1 or got <= steps // 4)

    def fill(s):
        return programs * s / (slots * -(-programs * s // slots))

    for s in range(1, min(-(-2 * sms // programs), steps // 4) + 1):  # none fills waves better
        assert fill(s) <= fill(got)
        if fill(s) == fill(got):  # a tie: the fewest where nearly full, else the most
            assert s >= got if fill(got) >= FULL_WAVE else s <= got


def test_wave_splits_ties():
    """The Triton FP8 config's rule keeps ties at more splits (2 splits 2-5% faster than 1 at
    256 programs on an H100, NOTES session 39); ``fewer_when_full`` only changes full waves."""
    assert wave_splits(256, 132, 2, 64) == 2
    assert wave_splits(256, 132, 2, 64, fewer_when_full=True) == 1
    assert wave_splits(192, 132, 2, 64) == wave_splits(192, 132, 2, 64, True) == 2
    assert wave_splits(4, 132, 2, 128) == wave_splits(4, 132, 2, 128, True) == 66


def _abstract(b, q_len, hq, hk, p, n=64, pt=16):
    sd = jax.ShapeDtypeStruct
    return [sd((b, q_len, hq, 128), jnp.bfloat16), sd((n, p, hk, 128), jnp.float8_e4m3fn),
            sd((n, p, hk, 128), jnp.float8_e4m3fn), sd((b, pt), jnp.int32), sd((b,), jnp.int32),
            sd((n, p, hk), jnp.float32), sd((n, p, hk), jnp.float32)]


@pytest.mark.parametrize("q_len,hq,hk,p,window,splits", [
    (1, 32, 4, 16, None, 2), (4, 32, 4, 16, 100, 3), (3, 64, 8, 32, None, 1),
    (2, 8, 8, 8, None, 1)])
def test_lowers_for_sm90(q_len, hq, hk, p, window, splits):
    """Mosaic GPU layout inference and the module build for an abstract H200 (no GPU)."""
    def f(q, k, v, bt, sl, ks, vs):
        return paged_decode_mosaic(q, k, v, bt, sl, k_scale=ks, v_scale=vs, scale=0.1,
                                   sliding_window=window, num_splits=splits)

    with abstract_gpu():
        text = jax.jit(f).trace(*_abstract(2, q_len, hq, hk, p)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


GPU_CASES = [
    # (id, Q, G, options, splits, geometry)
    ("q1_g8_auto", 1, 8, {}, None, GPU_GEO),
    ("q1_g8_s1", 1, 8, {}, 1, GPU_GEO),
    ("q4_g4_window_sinks", 4, 4, dict(window=700, sinks=True), None, GPU_GEO),
    ("q2_g8_s5", 2, 8, {}, 5, GPU_GEO),
    ("q3_g8_page8", 3, 8, dict(sinks=True), 2,
     Geometry(page_size=8, num_pages=700, num_kv_heads=2, table_pages=300)),
    ("q1_g1_page32", 1, 1, dict(window=100), 3,
     Geometry(page_size=32, num_pages=300, num_kv_heads=8, table_pages=60)),
]


@pytest.mark.skipif(not ON_GPU, reason="needs an sm_90 GPU: runs the compiled Mosaic GPU kernel")
@pytest.mark.parametrize("name,q_len,group,opts,splits,geo", GPU_CASES,
                         ids=[c[0] for c in GPU_CASES])
def test_compiled_on_gpu_against_reference(name, q_len, group, opts, splits, geo):
    seed = zlib.crc32(f"mosaic/{name}".encode()) % 1000
    args, kw = make_case(seed, KVDtype.FP8, q_len=q_len, group=group, d=128,
                         window=opts.get("window"), sinks=opts.get("sinks", False), geo=geo)
    ref = paged_decode_reference(*args, **kw)
    kw.pop("kv_dtype")
    out = paged_decode_mosaic(*args, **kw, num_splits=splits, out_dtype=jnp.float32)
    assert bool(jnp.all(jnp.isfinite(out))), "NaN/inf in the output (unwritten or poison read)"
    out, ref = np.asarray(out), np.asarray(ref)
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert rel <= TOL, f"relative error {rel:.2e}"
    assert np.max(np.abs(out - ref)) <= 20 * TOL * np.max(np.abs(ref))


def test_the_kernels_arithmetic_in_jnp():
    """The kernel's arithmetic stated in jnp on one sequence (the queries' and probabilities'
    two e4m3 terms, the V scales as log2 under a second running max): ~6e-4 from the f32
    reference, and ~10x worse with either lo term dropped (what the GPU run showed when XLA
    lost the queries' lo term)."""
    rng = np.random.default_rng(0)
    n, d, g = 4096, 128, 8
    q = jnp.asarray(rng.standard_normal((1, 1, g, d)), jnp.bfloat16)
    k8 = jnp.asarray(rng.standard_normal((n, d))).astype(jnp.float8_e4m3fn)
    v8 = jnp.asarray(rng.standard_normal((n, d))).astype(jnp.float8_e4m3fn)
    ks, vs = (jnp.asarray(rng.uniform(0.5, 1.5, n), jnp.float32) for _ in range(2))
    scale = d**-0.5
    s = q.astype(jnp.float32)[0, 0] @ (k8.astype(jnp.float32) * ks[:, None]).T * scale
    ref = jax.nn.softmax(s, axis=-1) @ (v8.astype(jnp.float32) * vs[:, None])
    qcat, qinv = query_terms(q, group=g, rows_pad=8, scale=scale)

    def kernel_math(q_lo: bool, p_lo_on: bool):
        hi, lo = qcat[0, 0, :8].astype(jnp.float32), qcat[0, 0, 8:].astype(jnp.float32)
        logits = ((hi + lo * q_lo) @ k8.astype(jnp.float32).T) * qinv[0, 0, :, None] * ks
        lv = logits + jnp.log2(vs)
        m, mv = logits.max(-1, keepdims=True), lv.max(-1, keepdims=True)
        pv = 2.0 ** (lv - mv) * 2.0**P_SHIFT  # <= 256: e4m3 (448) without reduce_precision
        p_hi = pv.astype(jnp.float8_e4m3fn).astype(jnp.float32)
        p_lo = (pv - p_hi).astype(jnp.float8_e4m3fn).astype(jnp.float32)
        l = (2.0 ** (logits - m)).sum(-1, keepdims=True)
        return (p_hi + p_lo * p_lo_on) @ v8.astype(jnp.float32) * 2.0 ** (mv - m - P_SHIFT) / l

    def err(out):
        return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))

    assert err(kernel_math(True, True)) < 1e-3
    assert err(kernel_math(False, True)) > 1e-2 and err(kernel_math(True, False)) > 1e-2


def test_checks_its_arguments_as_paged_decode():
    """The argument checks are paged_decode's (decode.check_decode_inputs): they raise before
    any kernel is built, on any machine."""
    q, k, v, bt, sl, ks, vs = (jnp.zeros(a.shape, a.dtype) for a in _abstract(2, 1, 32, 4, 16))
    kw = dict(k_scale=ks, v_scale=vs, scale=0.1)
    with pytest.raises(TypeError, match="seq_lens: expected an integer dtype"):
        paged_decode_mosaic(q, k, v, bt, sl.astype(jnp.float32), **kw)
    with pytest.raises(TypeError, match="q: expected dtype"):
        paged_decode_mosaic(q.astype(jnp.int8), k, v, bt, sl, **kw)
    with pytest.raises(ValueError, match="k_scale"):
        paged_decode_mosaic(q, k, v, bt, sl, k_scale=None, v_scale=vs, scale=0.1)
    with pytest.raises(NotImplementedError, match="head_dim 64"):
        paged_decode_mosaic(q[..., :64], k[..., :64], v[..., :64], bt, sl, **kw)
