"""Tests of pallas_kernels.paged_attention's prefill kernel against the plain-jnp reference.

The kernel runs in Pallas interpret mode on CPU (each variant is one compile, so every case packs
many situations into one batch). Every batch holds random data and ragged sequences: a
1-token prompt, prompts of a page - 1, and a page + 1, a chunk after a cached prefix ending
exactly on a page boundary, a long chunk after a long prefix (many pages), and a row of padding
only; the chunk length S is not a multiple of ``block_q``, and queries past a sequence's chunk
are padding (``q_pos = -1``, their q rows NaN). Block tables scatter every sequence over
non-contiguous pages; every page row no query may see (rows past the last query, rows and
whole pages before a sliding window) holds NaN, and the table entries of pages no query sees
hold garbage ids: one read of them shows up in the output. Interpret mode fills outputs with NaN
before the kernel runs, so "all finite" also means "every element written". A last class lowers
each variant to Triton IR for an abstract H200 (no GPU needed).
"""

from __future__ import annotations

import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._device import abstract_gpu
from pallas_kernels.paged_attention.config import (
    MAX_PREFILL_ROWS,
    KVDtype,
    PrefillConfig,
    choose_prefill_config,
)
from pallas_kernels.paged_attention.prefill import paged_prefill
from pallas_kernels.paged_attention.reference import paged_prefill_reference
from tests.test_paged_attention_kernel import (
    _STORE,
    ON_GPU,
    Geometry,
    assert_matches,
    make_pages,
    poison,
)

GEO = Geometry(page_size=8, num_pages=52, num_kv_heads=2, table_pages=8)  # 64 tokens a table
P = GEO.page_size
S = 13  # chunk length: a multiple of no block_q used here
# (cached prefix, chunk) per sequence: total 1, P - 1, P (after a prefix), P + 1, 50, padding
SEQS = [(0, 1), (0, P - 1), (3, P - 3), (0, P + 1), (37, S), (10, 0)]


def contiguous_q_pos(seqs=SEQS, s=S) -> np.ndarray:
    """[B, S] int32: ``prefix + arange(chunk)``, then -1 (padding)."""
    q_pos = np.full((len(seqs), s), -1, np.int32)
    for b, (prefix, chunk) in enumerate(seqs):
        q_pos[b, :chunk] = prefix + np.arange(chunk)
    return q_pos


def seen_positions(q_pos: np.ndarray, window: int | None, capacity: int) -> np.ndarray:
    """[B, capacity] bool: positions some query of the sequence sees."""
    t = np.arange(capacity)[None, None, :]
    qp = q_pos[:, :, None]
    vis = (qp >= 0) & (t <= qp)
    if window is not None:
        vis &= t > qp - window
    return vis.any(axis=1)


def make_case(seed, kv_dtype, *, q_pos, group, d, window=None, sinks=False, geo=GEO):
    """(positional args, keyword args) shared by the kernel and the reference."""
    p, n_pages, pt = geo.page_size, geo.num_pages, geo.table_pages
    seen = seen_positions(q_pos, window, pt * p).reshape(len(q_pos), pt, p)  # [B, Pt, P]
    rng = np.random.default_rng(seed)
    perm = iter(rng.permutation(n_pages))
    tables = np.where(np.arange(pt) % 2 == 0, -1, n_pages + 3) * np.ones((len(q_pos), 1), int)
    readable = np.zeros((n_pages, p), bool)
    for b, j in zip(*np.nonzero(seen.any(axis=2)), strict=True):
        tables[b, j] = page = next(perm)
        readable[page] = seen[b, j]
    hq = geo.num_kv_heads * group
    q = rng.standard_normal((*q_pos.shape, hq, d)).astype(np.float32)
    q[q_pos < 0] = np.nan  # padding queries: never read
    k = poison(make_pages(seed + 2, kv_dtype, d, geo), readable)
    v = poison(make_pages(seed + 3, kv_dtype, d, geo), readable)
    kw = dict(kv_dtype=kv_dtype, scale=d**-0.5, sliding_window=window)
    for which, arrays in (("k", k), ("v", v)):
        for name in ("scale", "global_scale"):
            if name in arrays:
                kw[f"{which}_{name}"] = jnp.asarray(arrays[name])
    if sinks:
        kw["sinks"] = jnp.asarray(rng.uniform(-1.0, 3.0, hq).astype(np.float32))
    args = (
        jnp.asarray(q).astype(jnp.bfloat16),
        jnp.asarray(k["data"]),
        jnp.asarray(v["data"]),
        jnp.asarray(tables, jnp.int32),
        jnp.asarray(q_pos),
    )
    return args, kw


_REF_STATIC = ("kv_dtype", "scale", "sliding_window", "logit_softcap")
reference = jax.jit(paged_prefill_reference, static_argnames=_REF_STATIC)


def run(args, kw, config, softcap=None, out_dtype=jnp.float32):
    """Kernel and reference outputs; padding queries must come out exactly 0."""
    out = paged_prefill(
        *args, **kw, logit_softcap=softcap, config=config, out_dtype=out_dtype, interpret=True
    )
    ref = reference(*args, **kw, logit_softcap=softcap)
    chex.assert_shape(out, args[0].shape)
    chex.assert_type(out, out_dtype)
    pad = np.asarray(args[4]) < 0
    assert np.all(np.asarray(out, np.float32)[pad] == 0), "padding queries must output 0"
    return out, ref


# ---------------------------------------------------------------------------------------------
# The kernel against the reference, per KV dtype.
# ---------------------------------------------------------------------------------------------

# (id, G, D, options, config). Window 11 starts mid-page and leaves whole pages of the long
# sequence before it; window 8 = one page. block_q * G rows: 8, 16, 16 (padded to >= 16).
CASES = {
    "g1_d64": (1, 64, {}, PrefillConfig(block_q=8, pages_per_step=2)),
    "g4_d128_window11": (4, 128, dict(window=11), PrefillConfig(4, 2)),
    "g8_d64_window8_softcap_sinks": (
        8,
        64,
        dict(window=8, softcap=5.0, sinks=True),
        PrefillConfig(2, 4, num_warps=8),
    ),
}


class PagedPrefillBase:
    """Run by one subclass per KV dtype, on the cases it names (one compile each)."""

    kv_dtype: KVDtype
    cases: tuple[str, ...]

    @pytest.mark.parametrize("name", list(CASES))
    def test_matches_reference(self, name):
        if name not in self.cases:
            pytest.skip(f"{name} is covered by the other KV dtypes (compile time)")
        group, d, opts, config = CASES[name]
        seed = zlib.crc32(f"{name}/{self.kv_dtype.value}".encode()) % 1000
        args, kw = make_case(
            seed,
            self.kv_dtype,
            q_pos=contiguous_q_pos(),
            group=group,
            d=d,
            window=opts.get("window"),
            sinks=opts.get("sinks", False),
        )
        out, ref = run(args, kw, config, softcap=opts.get("softcap"))
        assert_matches(out, ref, self.kv_dtype)


class TestFloat32(PagedPrefillBase):
    kv_dtype = KVDtype.FLOAT32
    cases = ("g1_d64",)


class TestBF16(PagedPrefillBase):
    kv_dtype = KVDtype.BF16
    cases = tuple(CASES)


class TestFP8(PagedPrefillBase):
    kv_dtype = KVDtype.FP8
    cases = ("g4_d128_window11", "g8_d64_window8_softcap_sinks")


class TestNVFP4(PagedPrefillBase):
    kv_dtype = KVDtype.NVFP4
    cases = ("g1_d64", "g8_d64_window8_softcap_sinks")


class TestOtherShapes:
    def test_head_dim_256_heuristic_config_bf16_out(self):
        """D = 256 with the heuristic's config and the output in q's dtype (bf16)."""
        args, kw = make_case(5, KVDtype.BF16, q_pos=contiguous_q_pos(), group=2, d=256)
        out, ref = run(args, kw, None, out_dtype=jnp.bfloat16)
        assert_matches(out, ref, KVDtype.BF16)

    def test_scattered_positions_split_group(self):
        """Queries at arbitrary, unordered positions with gaps wider than the window (the keys
        between two windows are poison, their pages garbage), and a program taking 2 of the 4
        query heads of a kv head."""
        q_pos = np.array(
            [[40, 3, -1, 41, 20, 0, 21], [5, -1, 6, -1, 63, 62, 30]], np.int32
        )  # [2, 7]
        args, kw = make_case(9, KVDtype.FP8, q_pos=q_pos, group=4, d=64, window=4, sinks=True)
        config = PrefillConfig(block_q=4, pages_per_step=2, q_heads_per_program=2)
        out, ref = run(args, kw, config)
        assert_matches(out, ref, KVDtype.FP8)

    def test_empty(self):
        args, kw = make_case(1, KVDtype.BF16, q_pos=contiguous_q_pos()[:, :0], group=1, d=64)
        out = paged_prefill(*args, **kw, interpret=True)
        chex.assert_shape(out, args[0].shape)


class TestReference:
    @pytest.mark.parametrize("kv_dtype", [KVDtype.NVFP4], ids=["nvfp4"])
    def test_matches_atlas_ops_reference(self, kv_dtype):
        """The same pages as an ``atlas_jax`` PagedKVCache give the ops-layer reference's output
        (its own gather and dequantization) for prefill chunks with padding queries."""
        from atlas_jax.attention.kv_cache import KVPages, PagedKVCache
        from atlas_jax.config import KVDtype as AjKVDtype
        from atlas_jax.ops.paged_attention import paged_attention_reference

        args, kw = make_case(3, kv_dtype, q_pos=contiguous_q_pos(), group=4, d=64, window=9)
        q, k_data, v_data, tables, q_pos = args
        # atlas_jax's reference reads every table page: valid ids, finite pages and queries.
        clean = lambda a: jnp.nan_to_num(a.astype(jnp.float32)).astype(a.dtype)  # noqa: E731
        tables = jnp.where((tables >= 0) & (tables < GEO.num_pages), tables, 0)
        q, k_data, v_data = clean(q), clean(k_data), clean(v_data)
        for name in ("k_scale", "v_scale", "k_global_scale", "v_global_scale"):
            if name in kw:
                kw[name] = clean(kw[name])
        aj = AjKVDtype(kv_dtype.value)
        pages = lambda w, x: KVPages(x, kw.get(f"{w}_scale"), kw.get(f"{w}_global_scale"), aj)  # noqa: E731
        cache = PagedKVCache(pages("k", k_data), pages("v", v_data), None, None, aj, 0)
        ops_ref = jax.jit(paged_attention_reference, static_argnames=("scale", "sliding_window"))
        want = ops_ref(q, cache, tables, q_pos, scale=kw["scale"], sliding_window=9)
        got = reference(q, k_data, v_data, tables, q_pos, **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Config and heuristic.
# ---------------------------------------------------------------------------------------------


class TestConfig:
    @pytest.mark.parametrize(
        "kwargs",
        [
            dict(block_q=3, pages_per_step=2),
            dict(block_q=0, pages_per_step=2),
            dict(block_q=4, pages_per_step=6),
            dict(block_q=4, pages_per_step=2, q_heads_per_program=0),
            dict(block_q=4, pages_per_step=2, num_warps=3),
            dict(block_q=4, pages_per_step=2, num_stages=0),
            dict(block_q=True, pages_per_step=2),
        ],
    )
    def test_invalid_config_raises(self, kwargs):
        with pytest.raises(ValueError, match="PrefillConfig"):
            PrefillConfig(**kwargs)

    def test_check_against_shapes(self):
        with pytest.raises(ValueError, match="tokens per step"):
            PrefillConfig(4, 1).check(page_size=8, q_per_kv=4)
        with pytest.raises(ValueError, match="divisor"):
            PrefillConfig(4, 2, q_heads_per_program=3).check(page_size=8, q_per_kv=4)
        with pytest.raises(ValueError, match="rows exceed"):
            PrefillConfig(128, 2).check(page_size=8, q_per_kv=4)
        cfg = PrefillConfig(2, 2)
        assert cfg.rows(7) == 16 and cfg.heads(7) == 7  # 14 rows padded to 16

    @pytest.mark.parametrize("kv_dtype", list(KVDtype), ids=[k.value for k in KVDtype])
    @pytest.mark.parametrize("d", [64, 128, 256, 512])
    @pytest.mark.parametrize("g", [1, 4, 7, 8])
    def test_heuristic_is_valid(self, kv_dtype, d, g):
        cfg = choose_prefill_config(1, 4, g, 4096, 256, 16, d, kv_dtype, 132)
        cfg.check(16, g)
        assert cfg.rows(g) <= max(16, min(128, 16384 // d)) * 2  # G = 7 pads up
        assert cfg.heads(g) == g

    def test_heuristic_shapes(self):
        cfg = choose_prefill_config(1, 4, 8, 16384, 1024, 16, 128, "bf16", 132)
        assert (cfg.block_q, cfg.rows(8), cfg.tokens_per_step(16), cfg.num_warps) == (
            16,
            128,
            64,
            8,
        )
        short = choose_prefill_config(1, 4, 8, 3, 4, 16, 128, "bf16", 132)  # a 3-token chunk
        assert short.block_q == 2 and short.rows(8) == 16
        few = choose_prefill_config(1, 1, 1, 256, 16, 16, 128, "bf16", 132)  # grid too small
        assert few.block_q == 16
        assert choose_prefill_config(1, 1, 1, 256, 16, 16, 128, "bf16", None).block_q == 128
        wide = choose_prefill_config(1, 2, 48, 64, 16, 16, 512, "fp8", 132)  # G = 48 > 32 rows
        assert wide.heads(48) == 24 and wide.block_q == 1
        wide.check(16, 48)
        tiny_pages = choose_prefill_config(2, 2, 4, 64, 64, 4, 64, "float32", None)
        assert tiny_pages.tokens_per_step(4) == 32
        assert MAX_PREFILL_ROWS >= 128

    def test_heuristic_rejects_bad_shapes(self):
        with pytest.raises(ValueError, match="q_len must be a positive int"):
            choose_prefill_config(1, 4, 8, 0, 4, 16, 128, "bf16", None)
        with pytest.raises(ValueError, match="page_size must be a power of two"):
            choose_prefill_config(1, 4, 8, 8, 4, 12, 128, "bf16", None)


# ---------------------------------------------------------------------------------------------
# Invalid inputs raise at trace time.
# ---------------------------------------------------------------------------------------------


def _sd(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _abstract(kv_dtype=KVDtype.BF16, *, b=2, s=5, hq=8, hk=2, d=64, n=16, page=8, pt=4):
    dd = d // 2 if kv_dtype is KVDtype.NVFP4 else d
    arrays = dict(
        q=_sd((b, s, hq, d), jnp.bfloat16),
        k_pages=_sd((n, page, hk, dd), _STORE[kv_dtype]),
        v_pages=_sd((n, page, hk, dd), _STORE[kv_dtype]),
        block_tables=_sd((b, pt), jnp.int32),
        q_pos=_sd((b, s), jnp.int32),
    )
    if kv_dtype is KVDtype.FP8:
        arrays.update(
            k_scale=_sd((n, page, hk), jnp.float32), v_scale=_sd((n, page, hk), jnp.float32)
        )
    if kv_dtype is KVDtype.NVFP4:
        sc, gs = _sd((n, page, hk, d // 16), jnp.float8_e4m3fn), _sd((n, page, hk), jnp.float32)
        arrays.update(k_scale=sc, v_scale=sc, k_global_scale=gs, v_global_scale=gs)
    return arrays, dict(kv_dtype=kv_dtype, scale=d**-0.5)


def _trace(arrays, static, **over):
    arrays = {**arrays, **{k: v for k, v in over.items() if isinstance(v, jax.ShapeDtypeStruct)}}
    static = {**static, **{k: v for k, v in over.items() if k not in arrays}}
    arrays = {k: v for k, v in arrays.items() if v is not None}
    f = lambda arrays: paged_prefill(**arrays, **static, interpret=True)  # noqa: E731
    return jax.eval_shape(f, arrays)


class TestInvalidInputs:
    @pytest.mark.parametrize(
        "over,err,match",
        [
            (dict(q_pos=_sd((2, 4), jnp.int32)), ValueError, "q_pos: expected shape"),
            (dict(q_pos=_sd((2, 5), jnp.float32)), TypeError, "q_pos: expected an integer"),
            (dict(q=_sd((2, 5, 7, 64), jnp.bfloat16)), ValueError, "kv heads"),
            (dict(block_tables=_sd((3, 4), jnp.int32)), ValueError, "block_tables"),
            (dict(sinks=_sd((7,), jnp.float32)), ValueError, "sinks"),
            (dict(sliding_window=0), ValueError, "sliding_window"),
            (dict(config=object()), TypeError, "PrefillConfig"),
            (dict(config=PrefillConfig(4, 1)), ValueError, "pages_per_step"),
            (dict(k_scale=_sd((16, 8, 2), jnp.float32)), ValueError, "k_scale"),
        ],
    )
    def test_bad_inputs(self, over, err, match):
        with pytest.raises(err, match=match):
            _trace(*_abstract(), **over)

    def test_unsupported_raise_not_implemented(self):
        with pytest.raises(NotImplementedError, match="head_dim 32"):
            _trace(*_abstract(d=32))
        with pytest.raises(NotImplementedError, match="page_size 12"):
            _trace(*_abstract(page=12))
        with pytest.raises(NotImplementedError, match="out_dtype"):
            _trace(*_abstract(), out_dtype=jnp.int8)


# ---------------------------------------------------------------------------------------------
# Compiled kernel on a GPU (skipped on CPU) and lowering to Triton IR for an abstract H200.
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled Triton kernel")
@pytest.mark.parametrize("kv_dtype", list(KVDtype), ids=[k.value for k in KVDtype])
@pytest.mark.parametrize("config", [None, PrefillConfig(16, 4, num_warps=8, num_stages=3)])
def test_compiled_on_gpu(kv_dtype, config):
    geo = Geometry(page_size=16, num_pages=600, num_kv_heads=4, table_pages=128)
    seqs = [(0, 1), (0, 700), (1000, 300), (17, 1024), (0, 0)]
    q_pos = contiguous_q_pos(seqs, 1024)
    args, kw = make_case(7, kv_dtype, q_pos=q_pos, group=8, d=128, window=600, sinks=True, geo=geo)
    out, ref = run(args, kw, config, softcap=30.0)
    assert_matches(out, ref, kv_dtype)


LOWERING_VARIANTS = [
    # (kv_dtype, d, hq, hk, options, config)
    (KVDtype.BF16, 128, 32, 4, {}, None),
    (KVDtype.FP8, 128, 32, 4, dict(sliding_window=512), PrefillConfig(16, 4, num_warps=8)),
    (KVDtype.NVFP4, 64, 16, 2, dict(logit_softcap=30.0, sinks=True), None),
    (KVDtype.FLOAT32, 256, 8, 8, {}, PrefillConfig(32, 2, q_heads_per_program=1)),
]


@pytest.mark.parametrize(
    "kv_dtype,d,hq,hk,opts,config",
    LOWERING_VARIANTS,
    ids=[f"v{i}_{v[0].value}_d{v[1]}" for i, v in enumerate(LOWERING_VARIANTS)],
)
def test_lowers_for_h200(kv_dtype, d, hq, hk, opts, config):
    arrays, static = _abstract(kv_dtype, b=2, s=300, hq=hq, hk=hk, d=d, n=1024, page=16, pt=64)
    opts = dict(opts)
    if opts.pop("sinks", False):
        arrays["sinks"] = _sd((hq,), jnp.float32)
    f = lambda arrays: paged_prefill(**arrays, **static, **opts, config=config)  # noqa: E731
    with abstract_gpu():
        lowered = jax.jit(f).trace(arrays).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()
