"""Tests of pallas_kernels.paged_attention: the decode kernel against the plain-jnp reference.

The kernel runs in Pallas interpret mode on CPU. Every case uses random data, ragged lengths
(one shorter than a page, one ending exactly on a page boundary, one a token past it, one
spanning many pages), block tables that scatter each sequence over non-contiguous pages, and
NaN poison in every page row no query may read (unreferenced pages, rows past ``seq_len``,
pages wholly before a sliding window, whose table entries are garbage too): one NaN read shows
up in the output. Interpret mode fills outputs with NaN before the kernel runs, so "all finite"
also means "every element written". A second class lowers each variant to Triton IR for an
abstract H200 (no GPU needed), which catches Pallas-Triton lowering errors interpret mode
cannot see.
"""

from __future__ import annotations

import zlib
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._dequant import e2m1_to_f16_scaled, fp8_to_f16
from pallas_kernels._device import abstract_gpu
from pallas_kernels.paged_attention import decode as decode_mod
from pallas_kernels.paged_attention.config import (
    DecodeConfig,
    KVDtype,
    choose_decode_config,
    kv_bytes_per_token,
)
from pallas_kernels.paged_attention.decode import (
    _pow2_row_scales,
    combine_splits,
    paged_decode,
)
from pallas_kernels.paged_attention.reference import (
    E2M1_VALUES,
    dequantize_pages,
    paged_decode_reference,
)


class Geometry(NamedTuple):
    page_size: int
    num_pages: int
    num_kv_heads: int
    table_pages: int  # block-table width


SMALL = Geometry(page_size=8, num_pages=40, num_kv_heads=2, table_pages=8)  # 64 tokens
P, NUM_PAGES, HK, PT = SMALL
ON_GPU = jax.devices()[0].platform == "gpu"
ALL_DTYPES = tuple(KVDtype)
_STORE = {
    KVDtype.FLOAT32: jnp.float32,
    KVDtype.BF16: jnp.bfloat16,
    KVDtype.FP8: jnp.float8_e4m3fn,
    KVDtype.NVFP4: jnp.uint8,
}


# ---------------------------------------------------------------------------------------------
# Helpers: data, poison, tolerances.
# ---------------------------------------------------------------------------------------------


def tolerance(kv_dtype: KVDtype) -> float:
    """Max ||out - ref|| / ||ref||. FLOAT32 pages run IEEE f32 dots; BF16 pages bf16 dots, FP8
    and NVFP4 f16 dots (exact K/V operands; the probabilities are rounded to bf16 / f16 for
    the P @ V dot, and an f32 q to bf16 / f16)."""
    return {
        KVDtype.FLOAT32: 1e-5,
        KVDtype.BF16: 1e-2,
        KVDtype.FP8: 3e-3,  # f16 operands
        KVDtype.NVFP4: 3e-3,
    }[kv_dtype]


def seq_lens_for(q_len: int, geo: Geometry = SMALL) -> np.ndarray:
    """Ragged lengths: <= one page, a page - 1, exactly two pages, one past, many pages."""
    p = geo.page_size
    return np.array([q_len, p - 1, 2 * p, 2 * p + 1, geo.table_pages * p - 3], np.int32)


def make_pages(seed: int, kv_dtype: KVDtype, d: int, geo: Geometry) -> dict[str, np.ndarray]:
    """Random (never zero) K or V pages of one dtype: {data, scale?, global_scale?} as numpy."""
    rng = np.random.default_rng(seed)
    shape = (geo.num_pages, geo.page_size, geo.num_kv_heads)
    match kv_dtype:
        case KVDtype.FLOAT32 | KVDtype.BF16:
            x = rng.standard_normal((*shape, d)).astype(np.float32)
            return dict(data=np.asarray(jnp.asarray(x).astype(_STORE[kv_dtype])))
        case KVDtype.FP8:
            x = np.clip(rng.standard_normal((*shape, d)) * 100.0, -440, 440)  # e4m3: no NaN
            data = np.asarray(jnp.asarray(x).astype(jnp.float8_e4m3fn))
            scale = rng.uniform(0.005, 0.02, shape).astype(np.float32)
            return dict(data=data, scale=scale)
        case KVDtype.NVFP4:
            data = rng.integers(0, 256, (*shape, d // 2), dtype=np.uint8)
            s = rng.uniform(0.5, 2.0, (*shape, d // 16)).astype(np.float32)
            scale = np.asarray(jnp.asarray(s).astype(jnp.float8_e4m3fn))
            gs = rng.uniform(0.05, 0.2, shape).astype(np.float32)
            return dict(data=data, scale=scale, global_scale=gs)


def make_tables(seed: int, seq_lens: np.ndarray, q_len: int, window: int | None, geo: Geometry):
    """Scattered block tables and the (page, row) cells any query may read.

    Each sequence takes its pages from one random permutation (non-contiguous, interleaved
    between sequences); table entries past a sequence's last page, and of pages wholly before
    its window, hold garbage ids (-1, or past the cache).
    """
    p, n_pages, pt = geo.page_size, geo.num_pages, geo.table_pages
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n_pages)
    tables = np.empty((len(seq_lens), pt), np.int32)
    readable = np.zeros((n_pages, p), bool)
    nxt = 0
    for b, n in enumerate(seq_lens):
        lo = 0 if window is None else max(int(n) - q_len - window + 1, 0)
        tables[b] = np.where(np.arange(pt) % 2 == 0, -1, n_pages + 3)
        for j in range(lo // p, -(-int(n) // p)):
            page = perm[nxt]
            nxt += 1
            tables[b, j] = page
            rows = np.arange(j * p, (j + 1) * p)
            readable[page] = (rows >= lo) & (rows < n)
    return tables, readable


def poison(arrays: dict[str, np.ndarray], readable: np.ndarray) -> dict[str, np.ndarray]:
    """NaN into every unreadable cell (NVFP4 codes have no NaN: its scales carry the poison)."""
    out = {}
    for name, a in arrays.items():
        if a.dtype == np.uint8:
            out[name] = a
            continue
        mask = ~readable.reshape(readable.shape + (1,) * (a.ndim - 2))
        nan = np.asarray(jnp.asarray(np.nan, jnp.float32).astype(a.dtype))
        out[name] = np.where(mask, nan, a).astype(a.dtype)
    return out


def make_case(
    seed,
    kv_dtype,
    *,
    q_len,
    group,
    d,
    window=None,
    sinks=False,
    q_dtype=jnp.bfloat16,
    geo: Geometry = SMALL,
):
    """(positional args, keyword args) shared by the kernel and the reference."""
    seq_lens = seq_lens_for(q_len, geo)
    tables, readable = make_tables(seed, seq_lens, q_len, window, geo)
    rng = np.random.default_rng(seed + 1)
    hq = geo.num_kv_heads * group
    q = rng.standard_normal((len(seq_lens), q_len, hq, d)).astype(np.float32)
    k = poison(make_pages(seed + 2, kv_dtype, d, geo), readable)
    v = poison(make_pages(seed + 3, kv_dtype, d, geo), readable)
    kw = dict(kv_dtype=kv_dtype, scale=d**-0.5, sliding_window=window)
    for which, arrays in (("k", k), ("v", v)):
        if "scale" in arrays:
            kw[f"{which}_scale"] = jnp.asarray(arrays["scale"])
        if "global_scale" in arrays:
            kw[f"{which}_global_scale"] = jnp.asarray(arrays["global_scale"])
    if sinks:
        kw["sinks"] = jnp.asarray(rng.uniform(-1.0, 3.0, hq).astype(np.float32))
    args = (
        jnp.asarray(q).astype(q_dtype),
        jnp.asarray(k["data"]),
        jnp.asarray(v["data"]),
        jnp.asarray(tables),
        jnp.asarray(seq_lens),
    )
    return args, kw


def assert_matches(out, ref, kv_dtype):
    assert bool(jnp.all(jnp.isfinite(out))), "NaN/inf in the output (unwritten or poison read)"
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert rel <= tolerance(kv_dtype), f"relative error {rel:.2e} > {tolerance(kv_dtype):.0e}"
    assert np.max(np.abs(out - ref)) <= 50 * tolerance(kv_dtype) * np.max(np.abs(ref))


# ---------------------------------------------------------------------------------------------
# The kernel against the reference, over every KV dtype.
# ---------------------------------------------------------------------------------------------

# (id, Q, G, D, options, config). Each case is one compile per dtype: together they cover
# Q = 1..4, GQA 1/4/8, D 64/128, window, softcap, sinks, one split and several (3 does not
# divide the page steps of every sequence, so some splits are short or empty).
CASES = [
    ("q1_g1_d64_s1", 1, 1, 64, {}, DecodeConfig(pages_per_step=2, num_splits=1)),
    ("q2_g4_d128_s3_window", 2, 4, 128, dict(window=13), DecodeConfig(2, 3)),
    ("q3_g8_d64_s2_softcap_sinks", 3, 8, 64, dict(softcap=5.0, sinks=True), DecodeConfig(4, 2)),
    ("q4_g4_d64_s1_window_sinks", 4, 4, 64, dict(window=5, sinks=True), DecodeConfig(2, 1)),
]


class PagedDecodeBase:
    """Run by one subclass per KV dtype."""

    kv_dtype: KVDtype

    @pytest.mark.parametrize("name,q_len,group,d,opts,config", CASES, ids=[c[0] for c in CASES])
    def test_matches_reference(self, name, q_len, group, d, opts, config):
        seed = zlib.crc32(f"{name}/{self.kv_dtype.value}".encode()) % 1000
        args, kw = make_case(
            seed,
            self.kv_dtype,
            q_len=q_len,
            group=group,
            d=d,
            window=opts.get("window"),
            sinks=opts.get("sinks", False),
        )
        kw["logit_softcap"] = opts.get("softcap")
        out = paged_decode(*args, **kw, config=config, out_dtype=jnp.float32, interpret=True)
        ref = paged_decode_reference(*args, **kw)
        chex.assert_shape(out, args[0].shape)
        chex.assert_type(out, jnp.float32)
        assert_matches(out, ref, self.kv_dtype)


class TestFloat32(PagedDecodeBase):
    kv_dtype = KVDtype.FLOAT32


class TestBF16(PagedDecodeBase):
    kv_dtype = KVDtype.BF16


class TestFP8(PagedDecodeBase):
    kv_dtype = KVDtype.FP8


class TestNVFP4(PagedDecodeBase):
    kv_dtype = KVDtype.NVFP4


class TestFP8Convert:
    """``DecodeConfig.v_convert`` / ``k_convert = "asm"`` (inline-PTX e4m3 -> f16 after the load
    on the GPU; its jnp twin in interpret mode) against the reference: FP8 pages, ragged
    lengths, poisoned unreadable cells."""

    @pytest.mark.parametrize(
        "config,opts",
        [
            (DecodeConfig(2, 1, v_convert="asm"), {}),
            (DecodeConfig(2, 3, v_convert="asm", k_convert="asm"), dict(window=13, sinks=True)),
            (DecodeConfig(4, 2, k_convert="asm"), dict(softcap=5.0)),
        ],
        ids=["v_s1", "kv_s3_window_sinks", "k_s2_softcap"],
    )
    def test_matches_reference(self, config, opts):
        args, kw = make_case(
            11,
            KVDtype.FP8,
            q_len=2,
            group=4,
            d=64,
            window=opts.get("window"),
            sinks=opts.get("sinks", False),
        )
        kw["logit_softcap"] = opts.get("softcap")
        out = paged_decode(*args, **kw, config=config, out_dtype=jnp.float32, interpret=True)
        cast = paged_decode(
            *args,
            **kw,
            config=DecodeConfig(config.pages_per_step, config.num_splits),
            out_dtype=jnp.float32,
            interpret=True,
        )
        assert_matches(out, paged_decode_reference(*args, **kw), KVDtype.FP8)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(cast))  # same values

    @pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled PTX conversion")
    @pytest.mark.parametrize(
        "config",
        [DecodeConfig(8, 3, 4, 4, v_convert="asm"), DecodeConfig(4, 1, 8, 2, "asm", "asm")],
        ids=["v_s3", "kv_s1_w8"],
    )
    def test_compiled_matches_reference(self, config):
        args, kw = make_case(23, KVDtype.FP8, q_len=2, group=8, d=128, window=700, geo=GPU_GEO)
        out = paged_decode(*args, **kw, config=config, out_dtype=jnp.float32)
        assert_matches(out, paged_decode_reference(*args, **kw), KVDtype.FP8)

    def test_fp8_to_f16_twin_is_exact(self):
        codes = jnp.arange(256, dtype=jnp.uint8).reshape(16, 16)
        x = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
        got = fp8_to_f16(x, inline_asm=False)
        chex.assert_type(got, jnp.float16)
        np.testing.assert_array_equal(
            np.asarray(got, np.float32), np.asarray(x.astype(jnp.float32))
        )


class TestOtherShapes:
    def test_head_dim_256_with_heuristic_config(self):
        """D = 256, f32 queries, default config (one split without a GPU), out dtype = q's."""
        args, kw = make_case(7, KVDtype.BF16, q_len=1, group=8, d=256, q_dtype=jnp.float32)
        out = paged_decode(*args, **kw, interpret=True)
        ref = paged_decode_reference(*args, **kw)
        chex.assert_type(out, jnp.float32)
        # q is rounded to bf16 for the bf16 dots: a little more error than the bf16 cases.
        assert_matches(out, ref, KVDtype.BF16)

    def test_many_splits_bf16_out_and_extreme_q(self):
        """More splits than any sequence has page steps (most splits are empty); f32 query
        rows of 1e5 (f16 overflows without the kernel's row scaling) and 1e-4, with K scaled
        down so the big rows' logits stay well conditioned."""
        args, kw = make_case(
            11, KVDtype.FP8, q_len=1, group=4, d=64, sinks=True, q_dtype=jnp.float32
        )
        q = args[0] * jnp.where(jnp.arange(args[0].shape[2]) % 2 == 0, 1e5, 1e-4)[:, None]
        args = (q, *args[1:])
        kw["k_scale"] = kw["k_scale"] * 1e-5
        out = paged_decode(
            *args, **kw, config=DecodeConfig(2, 7), out_dtype=jnp.bfloat16, interpret=True
        )
        ref = paged_decode_reference(*args, **kw)
        chex.assert_type(out, jnp.bfloat16)
        assert_matches(out, ref, KVDtype.FP8)

    @pytest.mark.parametrize("num_splits", [17, 40])
    def test_many_splits_q2_sinks_window(self, num_splits):
        """Split counts that are not powers of two and exceed the page steps of most
        sequences (many splits empty); Q = 2, sinks, a window."""
        args, kw = make_case(13, KVDtype.BF16, q_len=2, group=4, d=64, sinks=True, window=21)
        out = paged_decode(*args, **kw, config=DecodeConfig(2, num_splits),
                           out_dtype=jnp.float32, interpret=True)
        ref = paged_decode_reference(*args, **kw)
        assert_matches(out, ref, KVDtype.BF16)


    @pytest.mark.parametrize("num_splits,d,q_len,sinks", [(66, 128, 1, True), (3, 64, 3, False),
                                                          (2, 512, 2, True)])
    def test_combine_kernel_matches_combine_splits(self, num_splits, d, q_len, sinks):
        """The split-combine launch against its jnp statement on random partials: 66 splits
        (span 128, four column blocks of D 128), empty splits (lse -inf), a row no split saw,
        Q > 1, sinks; the output rows in (b, q, head) order and the output dtype."""
        b, hk, g = 2, 2, 4
        qg = q_len * g
        ko, kl, ks = jax.random.split(jax.random.key(num_splits), 3)
        o = jax.random.normal(ko, (b, hk, num_splits, qg, d), jnp.float32)
        lse = jax.random.normal(kl, (b, hk, num_splits, qg), jnp.float32) * 4
        lse = lse.at[:, :, ::2].set(-jnp.inf)  # empty splits
        lse = lse.at[1, 1, :, 0].set(-jnp.inf)  # a row no split saw
        sink = jax.random.normal(ks, (hk * g,), jnp.float32) if sinks else None
        st = decode_mod._Static(
            kv_dtype=KVDtype.BF16, q_len=q_len, num_q_heads=hk * g, num_kv_heads=hk, group=g,
            head_dim=d, page_size=16, max_pages=4, rows=16, pages_per_step=1,
            num_splits=num_splits, scale=1.0, sliding_window=None, logit_softcap=None,
            inline_asm=False)
        got = decode_mod.combine_pallas(o.reshape(-1, d), lse.reshape(-1), sink, st=st,
                                         batch=b, out_dtype=jnp.bfloat16, interpret=True)
        want = combine_splits(o, lse, sink, q_len=q_len)  # [B, Q, Hq, D]
        chex.assert_type(got, jnp.bfloat16)
        np.testing.assert_allclose(np.asarray(got, np.float32).reshape(want.shape),
                                   np.asarray(want.astype(jnp.bfloat16), np.float32),
                                   rtol=1e-2, atol=1e-2)
        if not sinks:  # a row no split saw and no sink: 0
            assert not np.any(np.asarray(got, np.float32).reshape(want.shape)[1, 0, 4])

    def test_combine_columns(self):
        """All splits in one tile of <= COMBINE_TILE f32, columns a power of two >= 16."""
        assert decode_mod.combine_columns(66, 128) == (128, 32)
        assert decode_mod.combine_columns(2, 512) == (2, 512)
        assert decode_mod.combine_columns(3, 128) == (4, 128)
        assert decode_mod.combine_columns(4096, 64) == (4096, 16)


# ---------------------------------------------------------------------------------------------
# Reference: agreement with atlas_jax's cache layout and dequantization.
# ---------------------------------------------------------------------------------------------


class TestReference:
    @pytest.mark.parametrize("kv_dtype", ALL_DTYPES, ids=[k.value for k in ALL_DTYPES])
    def test_matches_atlas_ops_reference(self, kv_dtype):
        """The same pages as an ``atlas_jax`` PagedKVCache give the ops-layer reference's
        output (layout: [N, P, K, D], low nibble = even d, per-token scales)."""
        from atlas_jax.attention.kv_cache import KVPages, PagedKVCache
        from atlas_jax.config import KVDtype as AjKVDtype
        from atlas_jax.ops.paged_attention import paged_attention_reference

        q_len = 2
        args, kw = make_case(3, kv_dtype, q_len=q_len, group=4, d=64, window=9, sinks=True)
        # atlas_jax's reference reads every table page: give it valid ids and finite pages.
        unpoison = lambda a: jnp.where(  # noqa: E731
            jnp.isnan(a.astype(jnp.float32)), 0, a
        ).astype(a.dtype)
        q, k_data, v_data, tables, seq_lens = args
        tables = jnp.where((tables >= 0) & (tables < NUM_PAGES), tables, 0)
        k_data, v_data = unpoison(k_data), unpoison(v_data)
        for name in ("k_scale", "v_scale", "k_global_scale", "v_global_scale"):
            if name in kw:
                kw[name] = unpoison(kw[name])

        aj_dtype = AjKVDtype(kv_dtype.value)
        pages = lambda w, data: KVPages(  # noqa: E731
            data, kw.get(f"{w}_scale"), kw.get(f"{w}_global_scale"), aj_dtype
        )
        cache = PagedKVCache(pages("k", k_data), pages("v", v_data), None, None, aj_dtype, 0)
        q_pos = seq_lens[:, None] - q_len + jnp.arange(q_len)[None, :]
        expected = paged_attention_reference(
            q,
            cache,
            tables,
            q_pos,
            scale=kw["scale"],
            sliding_window=kw["sliding_window"],
            sinks=kw["sinks"],
        )
        ours = paged_decode_reference(q, k_data, v_data, tables, seq_lens, **kw)
        np.testing.assert_allclose(np.asarray(ours), np.asarray(expected), rtol=1e-5, atol=1e-5)

    def test_e2m1_bits_match_table(self):
        codes = jnp.arange(16, dtype=jnp.int32) | 0x30  # high bits are ignored
        vals = np.asarray(e2m1_to_f16_scaled(codes).astype(jnp.float32)) * 2.0**14
        np.testing.assert_array_equal(vals, E2M1_VALUES)
        np.testing.assert_array_equal(np.signbit(vals), np.signbit(E2M1_VALUES))

    def test_pow2_row_scales(self):
        amax = jnp.array([3.0, 1e-30, 0.0, 7e4, 1e30, 2.0**10], jnp.float32)
        up, down = _pow2_row_scales(amax)
        scaled = np.asarray(amax * up)
        normal = np.asarray(amax) > 2.0**-100
        assert np.all((scaled[normal] >= 2.0**10) & (scaled[normal] < 2.0**11))
        np.testing.assert_array_equal(np.asarray(up * down), 1.0)  # exact inverses
        assert np.all(np.log2(np.asarray(up)) % 1 == 0)

    def test_dequantize_nvfp4_nibble_order(self):
        data = jnp.array([[0x21] * 8], jnp.uint8)  # low nibble 1 (0.5) = even d, high 2 (1.0)
        scale = jnp.array([[2.0]], jnp.float32).astype(jnp.float8_e4m3fn)
        out = dequantize_pages(data, "nvfp4", scale, jnp.array([3.0]))
        np.testing.assert_array_equal(np.asarray(out[0, :4]), [3.0, 6.0, 3.0, 6.0])


# ---------------------------------------------------------------------------------------------
# Config and heuristic.
# ---------------------------------------------------------------------------------------------


class TestConfig:
    @pytest.mark.parametrize(
        "kwargs",
        [
            dict(pages_per_step=3),
            dict(pages_per_step=0),
            dict(pages_per_step=4, num_splits=0),
            dict(pages_per_step=4, num_warps=3),
            dict(pages_per_step=4, num_stages=0),
            dict(pages_per_step=4, num_splits=True),
            dict(pages_per_step=4, v_convert="ptx"),
            dict(pages_per_step=4, k_convert=None),
        ],
    )
    def test_invalid_config_raises(self, kwargs):
        with pytest.raises(ValueError, match="DecodeConfig"):
            DecodeConfig(**kwargs)

    def test_too_few_tokens_per_step_raises(self):
        with pytest.raises(ValueError, match="pages_per_step"):
            DecodeConfig(1).check(page_size=8)

    @pytest.mark.parametrize("kv_dtype", ALL_DTYPES, ids=[k.value for k in ALL_DTYPES])
    @pytest.mark.parametrize("d", [64, 128, 256, 512])
    def test_heuristic_fills_the_gpu_at_batch_1(self, kv_dtype, d):
        sms = 132  # an H200's count, passed in as the device would report it
        cfg = choose_decode_config(1, 8, 8, 1, 2048, 16, d, kv_dtype, sms)
        assert 1 * 8 * cfg.num_splits >= sms
        t = cfg.tokens_per_step(16)
        assert t >= 16 and t & (t - 1) == 0
        cfg.check(16)

    def test_heuristic_large_batch_needs_no_split(self):
        cfg = choose_decode_config(128, 8, 8, 1, 256, 16, 128, KVDtype.BF16, 132)
        assert cfg.num_splits == 1

    @pytest.mark.parametrize(
        "b,hk,ctx,kv_dtype,splits",
        [(32, 4, 16384, "fp8", 2), (32, 4, 4096, "fp8", 2), (1, 4, 32768, "fp8", 66),
         (8, 4, 16384, "fp8", 8), (32, 8, 16384, "fp8", 2), (32, 4, 4096, "bf16", 3),
         (32, 8, 4096, "bf16", 2), (8, 4, 16384, "nvfp4", 9), (1, 8, 16384, "bf16", 33),
         (1, 4, 32768, "bf16", 66), (128, 4, 1024, "bf16", 1)],
    )
    def test_heuristic_grid_is_whole_waves(self, b, hk, ctx, kv_dtype, splits):
        """Programs = splits x B x Hk fill the last wave of RESIDENT_PROGRAMS x SMs best (the
        H200 cases the rule was measured on); FP8 pages pipeline 2 steps deep."""
        cfg = choose_decode_config(b, hk, 8, 1, ctx // 16, 16, 128, kv_dtype, 132)
        assert cfg.num_splits == splits
        assert cfg.num_stages == 2 or kv_dtype != "fp8"

    def test_heuristic_uses_reported_sm_count(self):
        a = choose_decode_config(1, 4, 8, 1, 2048, 16, 128, "bf16", 66)
        b = choose_decode_config(1, 4, 8, 1, 2048, 16, 128, "bf16", 132)
        assert b.num_splits > a.num_splits

    def test_heuristic_short_table_and_no_gpu(self):
        cfg = choose_decode_config(1, 4, 8, 1, 2, 16, 128, "fp8", 132)
        assert cfg.num_splits == 1 and cfg.tokens_per_step(16) >= 16
        assert choose_decode_config(1, 4, 8, 1, 2048, 16, 128, "fp8", None).num_splits == 1
        cfg = choose_decode_config(2, 4, 8, 1, 64, 4, 64, "nvfp4", 132)  # tiny pages
        cfg.check(4)

    def test_kv_bytes(self):
        assert kv_bytes_per_token("bf16", 8, 128) == 2 * 8 * 256
        assert kv_bytes_per_token("fp8", 8, 128) == 2 * 8 * (128 + 4)
        assert kv_bytes_per_token("nvfp4", 8, 128) == 2 * 8 * (64 + 8 + 4)

    def test_kv_dtype_coerce(self):
        assert KVDtype.coerce("nvfp4") is KVDtype.NVFP4
        with pytest.raises(ValueError, match="kv_dtype"):
            KVDtype.coerce("int8")


# ---------------------------------------------------------------------------------------------
# Invalid inputs raise at trace time.
# ---------------------------------------------------------------------------------------------


def _sd(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _abstract_inputs(kv_dtype=KVDtype.BF16, *, b=2, q_len=1, hq=8, d=64, n=16, pt=4):
    dd = d // 2 if kv_dtype is KVDtype.NVFP4 else d
    args = [
        _sd((b, q_len, hq, d), jnp.bfloat16),
        _sd((n, P, HK, dd), _STORE[kv_dtype]),
        _sd((n, P, HK, dd), _STORE[kv_dtype]),
        _sd((b, pt), jnp.int32),
        _sd((b,), jnp.int32),
    ]
    kw = dict(kv_dtype=kv_dtype, scale=0.125)
    if kv_dtype is KVDtype.FP8:
        kw.update(k_scale=_sd((n, P, HK), jnp.float32), v_scale=_sd((n, P, HK), jnp.float32))
    if kv_dtype is KVDtype.NVFP4:
        s = _sd((n, P, HK, d // 16), jnp.float8_e4m3fn)
        gs = _sd((n, P, HK), jnp.float32)
        kw.update(k_scale=s, v_scale=s, k_global_scale=gs, v_global_scale=gs)
    return args, kw


def _trace(args, kw, **over):
    kw = {**kw, **over}
    arrays = {k: v for k, v in kw.items() if isinstance(v, jax.ShapeDtypeStruct)}
    static = {k: v for k, v in kw.items() if k not in arrays}
    f = lambda *a, arrays: paged_decode(*a, **arrays, **static, interpret=True)  # noqa: E731
    return jax.eval_shape(f, *args, arrays=arrays)


class TestInvalidInputs:
    @pytest.mark.parametrize(
        "index,shape,dtype,match",
        [
            (0, (2, 1, 8), jnp.bfloat16, "q: expected rank 4"),
            (0, (2, 1, 7, 64), jnp.bfloat16, "kv heads"),
            (0, (2, 1, 8, 32), jnp.bfloat16, "head_dim"),
            (0, (2, 1, 8, 64), jnp.int32, "q: expected dtype"),
            (2, (16, P, HK, 32), jnp.bfloat16, "v_pages"),
            (3, (3, 4), jnp.int32, "block_tables"),
            (4, (3,), jnp.int32, "seq_lens"),
            (1, (16, P, HK, 64), jnp.float32, "k_pages"),
        ],
    )
    def test_bad_shapes_and_dtypes(self, index, shape, dtype, match):
        args, kw = _abstract_inputs()
        args[index] = _sd(shape, dtype)
        with pytest.raises((ValueError, TypeError), match=match):
            _trace(args, kw)

    @pytest.mark.parametrize(
        "kv_dtype,over,match",
        [
            (KVDtype.FP8, dict(k_scale=None), "k_scale"),
            (KVDtype.FP8, dict(v_scale=_sd((16, P, HK, 1), jnp.float32)), "v_scale"),
            (KVDtype.NVFP4, dict(k_global_scale=None), "k_global_scale"),
            (KVDtype.NVFP4, dict(v_scale=_sd((16, P, HK, 4), jnp.float32)), "v_scale"),
            (KVDtype.BF16, dict(k_scale=_sd((16, P, HK), jnp.float32)), "k_scale"),
            (KVDtype.BF16, dict(sinks=_sd((7,), jnp.float32)), "sinks"),
            (KVDtype.BF16, dict(scale=0.0), "scale"),
            (KVDtype.BF16, dict(sliding_window=0), "sliding_window"),
            (KVDtype.BF16, dict(logit_softcap=-1.0), "logit_softcap"),
            (KVDtype.BF16, dict(kv_dtype="int8"), "kv_dtype"),
            (KVDtype.BF16, dict(config=DecodeConfig(1)), "pages_per_step"),
            (KVDtype.BF16, dict(config=DecodeConfig(2, v_convert="asm")), "FP8 pages only"),
            (KVDtype.NVFP4, dict(config=DecodeConfig(2, k_convert="asm")), "FP8 pages only"),
        ],
    )
    def test_bad_options(self, kv_dtype, over, match):
        args, kw = _abstract_inputs(kv_dtype)
        with pytest.raises((ValueError, TypeError), match=match):
            _trace(args, kw, **over)

    def test_unsupported_raise_not_implemented(self):
        args, kw = _abstract_inputs()
        args[1] = args[2] = _sd((16, 12, HK, 64), jnp.bfloat16)  # page size 12
        with pytest.raises(NotImplementedError, match="page_size"):
            _trace(args, kw)
        args, kw = _abstract_inputs(q_len=4, hq=128)  # 4 * 64 rows per kv head
        with pytest.raises(NotImplementedError, match="rows"):
            _trace(args, kw)
        args, kw = _abstract_inputs(d=32)
        with pytest.raises(NotImplementedError, match="head_dim"):
            _trace(args, kw)
        args, kw = _abstract_inputs()
        with pytest.raises(NotImplementedError, match="out_dtype"):
            _trace(args, kw, out_dtype=jnp.int8)


# ---------------------------------------------------------------------------------------------
# Compiled kernel on a GPU (skipped on CPU): the Triton build, at realistic shapes.
# ---------------------------------------------------------------------------------------------

GPU_GEO = Geometry(page_size=16, num_pages=1024, num_kv_heads=4, table_pages=160)
GPU_CASES = [
    # (id, Q, G, D, options, config); config None: the heuristic with the device's SM count
    ("q1_g8_d128_auto", 1, 8, 128, {}, None),
    ("q1_g8_d128_s1", 1, 8, 128, {}, DecodeConfig(8, 1)),
    ("q4_g4_d128_opts", 4, 4, 128, dict(window=700, softcap=30.0, sinks=True), None),
    ("q2_g8_d256_s5", 2, 8, 256, {}, DecodeConfig(4, 5, 8, 2)),
    ("q1_g1_d64_auto", 1, 1, 64, dict(sinks=True), None),
]


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled Triton kernel")
class TestCompiledOnGpu:
    @pytest.mark.parametrize("kv_dtype", ALL_DTYPES, ids=[k.value for k in ALL_DTYPES])
    @pytest.mark.parametrize(
        "name,q_len,group,d,opts,config", GPU_CASES, ids=[c[0] for c in GPU_CASES]
    )
    def test_matches_reference(self, kv_dtype, name, q_len, group, d, opts, config):
        seed = zlib.crc32(f"gpu/{name}/{kv_dtype.value}".encode()) % 1000
        args, kw = make_case(
            seed,
            kv_dtype,
            q_len=q_len,
            group=group,
            d=d,
            window=opts.get("window"),
            sinks=opts.get("sinks", False),
            geo=GPU_GEO,
        )
        kw["logit_softcap"] = opts.get("softcap")
        out = paged_decode(*args, **kw, config=config, out_dtype=jnp.float32)
        ref = paged_decode_reference(*args, **kw)
        assert_matches(out, ref, kv_dtype)


# ---------------------------------------------------------------------------------------------
# Lowering to Triton IR for an abstract H200 (no GPU needed).
# ---------------------------------------------------------------------------------------------

LOWERING_VARIANTS = [
    # (kv_dtype, d, q_len, hq, hk, page, options, config)
    (KVDtype.BF16, 128, 1, 32, 4, 16, {}, DecodeConfig(8, 4, 4, 2)),
    (KVDtype.FLOAT32, 128, 1, 32, 4, 16, {}, DecodeConfig(4, 1, 4, 2)),
    (KVDtype.FP8, 128, 4, 32, 4, 16, dict(sliding_window=128), DecodeConfig(8, 2, 4, 3)),
    (KVDtype.NVFP4, 128, 1, 64, 8, 16, dict(logit_softcap=30.0), DecodeConfig(8, 8, 4, 3)),
    (KVDtype.BF16, 256, 3, 32, 4, 16, dict(sinks=True), DecodeConfig(4, 1, 8, 2)),
    (KVDtype.NVFP4, 512, 2, 32, 4, 16, dict(sinks=True), DecodeConfig(2, 2, 8, 2)),
    (KVDtype.FP8, 64, 1, 8, 8, 32, {}, None),  # heuristic config, MHA
    # the heuristic's B=1 32k split count (66): not a power of two
    (KVDtype.BF16, 128, 1, 32, 4, 16, dict(sinks=True), DecodeConfig(8, 66, 4, 2)),
    # FP8 V (and K) converted with inline PTX after the load (DecodeConfig.v_convert / k_convert)
    (KVDtype.FP8, 128, 1, 32, 4, 16, {}, DecodeConfig(8, 3, 4, 4, v_convert="asm")),
    (
        KVDtype.FP8,
        256,
        2,
        32,
        4,
        16,
        dict(sinks=True, logit_softcap=30.0),
        DecodeConfig(4, 1, 8, 2, v_convert="asm", k_convert="asm"),
    ),
]


class TestTritonLowering:
    @pytest.mark.parametrize(
        "kv_dtype,d,q_len,hq,hk,page,opts,config",
        LOWERING_VARIANTS,
        ids=[f"v{i}_{v[0].value}_d{v[1]}" for i, v in enumerate(LOWERING_VARIANTS)],
    )
    def test_lowers_for_h200(self, kv_dtype, d, q_len, hq, hk, page, opts, config):
        n, b, pt = 1024, 4, 64
        dd = d // 2 if kv_dtype is KVDtype.NVFP4 else d
        arrays = dict(
            k_pages=_sd((n, page, hk, dd), _STORE[kv_dtype]),
            v_pages=_sd((n, page, hk, dd), _STORE[kv_dtype]),
        )
        if kv_dtype is KVDtype.FP8:
            arrays.update(
                k_scale=_sd((n, page, hk), jnp.float32), v_scale=_sd((n, page, hk), jnp.float32)
            )
        if kv_dtype is KVDtype.NVFP4:
            s, gs = _sd((n, page, hk, d // 16), jnp.float8_e4m3fn), _sd((n, page, hk), jnp.float32)
            arrays.update(k_scale=s, v_scale=s, k_global_scale=gs, v_global_scale=gs)
        opts = dict(opts)
        if opts.pop("sinks", False):
            arrays["sinks"] = _sd((hq,), jnp.float32)

        def f(q, tables, lens, arrays):
            arrays = dict(arrays)
            kp, vp = arrays.pop("k_pages"), arrays.pop("v_pages")
            return paged_decode(
                q,
                kp,
                vp,
                tables,
                lens,
                kv_dtype=kv_dtype,
                scale=d**-0.5,
                config=config,
                **arrays,
                **opts,
            )

        q = _sd((b, q_len, hq, d), jnp.bfloat16)
        with abstract_gpu():
            lowered = (
                jax.jit(f)
                .trace(q, _sd((b, pt), jnp.int32), _sd((b,), jnp.int32), arrays)
                .lower(lowering_platforms=("cuda",))
            )
        text = lowered.as_text()
        assert "__gpu$xla.gpu.triton" in text
        launches = text.count("__gpu$xla.gpu.triton")  # decode, and the combine after a split
        assert launches == (1 + (config.num_splits > 1) if config is not None else launches)
        assert launches in (1, 2)
        asm = config is not None and "asm" in (config.v_convert, config.k_convert)
        assert ("cvt.rn.f16x2.e4m3x2" in text) == asm  # the PTX e4m3 conversion, when chosen
