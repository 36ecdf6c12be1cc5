"""attention.decode and attention.prefill through the Pallas kernels (interpret mode on CPU)
equal the XLA reference path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import atlas_jax as aj

XLA = aj.KernelConfig(paged_attention="xla")
PALLAS = aj.KernelConfig(paged_attention="pallas")


def setup(kv_dtype, **cfg_kw):
    cfg = aj.AttentionConfig(hidden_size=128, num_heads=8, num_kv_heads=2, head_dim=64,
                             **cfg_kw)
    params = aj.attention.init_params(jax.random.key(0), cfg, dtype=jnp.float32)
    cache = aj.PagedKVCache.create(24, 4, cfg, dtype=kv_dtype)
    tables = jnp.array([[5, 1, 9, 14, 2, 20], [3, 17, 0, 8, 11, 6]], jnp.int32)
    x = jax.random.normal(jax.random.key(1), (2, 13, 128))
    _, cache = aj.attention.prefill(params, x, cache, tables, jnp.zeros(2, jnp.int32),
                                    lengths=jnp.array([13, 9]))
    return params, cache, tables


@pytest.mark.parametrize("kv_dtype", list(aj.KVDtype))
@pytest.mark.parametrize("q_len", [1, 3])
def test_decode_pallas_equals_xla(kv_dtype, q_len):
    params, cache, tables = setup(kv_dtype)
    x = jax.random.normal(jax.random.key(2), (2, q_len, 128))
    seq = jnp.array([13, 9]) + q_len
    want, c1 = aj.attention.decode(params, x, cache, tables, seq, kernels=XLA)
    got, c2 = aj.attention.decode(params, x, cache, tables, seq, kernels=PALLAS)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 2e-2, err
    jax.tree.map(np.testing.assert_array_equal, c1, c2)  # the write is the same either way


def test_decode_pallas_window_softcap_splits():
    params, cache, tables = setup(aj.KVDtype.BF16, sliding_window=5, logit_softcap=20.0)
    x = jax.random.normal(jax.random.key(3), (2, 2, 128))
    seq = jnp.array([15, 11])
    want, _ = aj.attention.decode(params, x, cache, tables, seq, kernels=XLA)
    k = PALLAS.replace(attn_num_splits=2, attn_block_pages=4)
    got, _ = aj.attention.decode(params, x, cache, tables, seq, kernels=k)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2


def test_prefill_pallas_chunk_after_prefix_equals_xla():
    """A chunk of 6 after the cached 13 / 9 tokens, the second row 2 tokens of padding."""
    params, cache, tables = setup(aj.KVDtype.NVFP4)
    x = jax.random.normal(jax.random.key(4), (2, 6, 128))
    start, lens = jnp.array([13, 9]), jnp.array([6, 4])
    want, c1 = aj.attention.prefill(params, x, cache, tables, start, lengths=lens, kernels=XLA)
    got, c2 = aj.attention.prefill(params, x, cache, tables, start, lengths=lens, kernels=PALLAS)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
    jax.tree.map(np.testing.assert_array_equal, c1, c2)


def test_one_byte_arrays_of_2_to_4_gib_in_the_cache():
    """A 1-byte cache array of more than 2**31 elements in at most 2**32 bytes would be indexed
    with overflowing int32 offsets by Pallas' Triton lowering. FP8 / NVFP4 pages of that size go
    to the kernels through their uint16 view; an NVFP4 block-scale array of that size has none:
    "pallas" raises, "auto" names it. (Abstract shapes only: nothing is allocated.)"""
    from atlas_jax.ops.paged_attention import paged_attention, pallas_unsupported

    cfg = aj.AttentionConfig(hidden_size=1024, num_heads=32, num_kv_heads=8, head_dim=128)
    q = jax.ShapeDtypeStruct((1, 1, 32, 128), jnp.bfloat16)

    def cache_of(pages, dtype):
        return jax.eval_shape(lambda: aj.PagedKVCache.create(pages, 16, cfg, dtype))

    for pages in (150_000, 120_000, 300_000):  # 2.46e9 / 1.97e9 / 4.9e9 bytes of FP8 pages
        assert pallas_unsupported(q, cache_of(pages, aj.KVDtype.FP8)) is None, pages
    cache = cache_of(2_200_000, aj.KVDtype.NVFP4)  # block scales: 2.25e9 e4m3
    assert "k_scale" in pallas_unsupported(q, cache) and "int32 offsets" in pallas_unsupported(
        q, cache)
    with pytest.raises(NotImplementedError, match="int32 offsets"):
        jax.eval_shape(lambda q, c: paged_attention(
            q, c, jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 1), jnp.int32), scale=0.1,
            seq_lens=jnp.ones(1, jnp.int32), kernels=PALLAS), q, cache)


def test_attn_decode_kernel_choice(monkeypatch):
    """"auto" takes the Mosaic GPU FP8 kernel on sm_90 for the caches it supports up to 32
    query rows a kv head; "mosaic" raises naming why it cannot run (interpret mode, the KV
    dtype)."""
    from atlas_jax.ops import paged_attention as op
    from pallas_kernels import grouped_matmul as gm

    cfg = aj.AttentionConfig(hidden_size=128, num_heads=32, num_kv_heads=4, head_dim=128)
    fp8 = aj.PagedKVCache.create(8, 16, cfg, dtype=aj.KVDtype.FP8)
    bf16 = aj.PagedKVCache.create(8, 16, cfg, dtype=aj.KVDtype.BF16)
    mosaic = aj.KernelConfig(attn_decode_kernel="mosaic")
    monkeypatch.setattr(op, "interpret_mode", lambda: True)
    with pytest.raises(NotImplementedError, match="interpret mode"):
        op._use_mosaic(jnp.zeros((8, 1, 32, 128)), fp8, None, mosaic)
    monkeypatch.setattr(op, "interpret_mode", lambda: False)
    monkeypatch.setattr(gm, "device_compute_capability", lambda: (9, 0))
    auto = aj.KernelConfig()
    assert op._use_mosaic(jnp.zeros((8, 1, 32, 128)), fp8, None, auto)
    assert op._use_mosaic(jnp.zeros((1, 4, 32, 128)), fp8, None, auto)
    assert not op._use_mosaic(jnp.zeros((1, 1, 32, 128)), fp8, None,
                              auto.replace(attn_block_pages=8))
    assert not op._use_mosaic(jnp.zeros((1, 4, 80, 128)), fp8, None, auto)  # 4 x 20 > 64 rows
    # 48 and 64 rows: the kernel runs them ("mosaic") but spills; "auto" takes Triton
    assert not op._use_mosaic(jnp.zeros((1, 3, 64, 128)), fp8, None, auto)
    assert not op._use_mosaic(jnp.zeros((1, 4, 64, 128)), fp8, None, auto)
    assert op._use_mosaic(jnp.zeros((1, 4, 64, 128)), fp8, None, mosaic)
    assert not op._use_mosaic(jnp.zeros((8, 1, 32, 128)), bf16, None, auto)
    assert not op._use_mosaic(jnp.zeros((8, 1, 32, 128)), fp8, 30.0, auto)  # softcap
    assert not op._use_mosaic(jnp.zeros((8, 1, 32, 128)), fp8, None,
                              auto.replace(attn_decode_kernel="triton"))
    assert op._use_mosaic(jnp.zeros((1, 1, 32, 128)), fp8, None, mosaic)
    with pytest.raises(NotImplementedError, match="FP8 pages"):
        op._use_mosaic(jnp.zeros((8, 1, 32, 128)), bf16, None, mosaic)
    monkeypatch.setattr(gm, "device_compute_capability", lambda: (10, 0))
    assert not op._use_mosaic(jnp.zeros((8, 1, 32, 128)), fp8, None, auto)


@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs an sm_90 GPU")
@pytest.mark.parametrize("q_len", [1, 3])
def test_decode_mosaic_fp8_equals_xla_on_gpu(q_len):
    cfg = aj.AttentionConfig(hidden_size=256, num_heads=16, num_kv_heads=2, head_dim=128,
                             sliding_window=20)
    params = aj.attention.init_params(jax.random.key(0), cfg, dtype=jnp.float32)
    cache = aj.PagedKVCache.create(24, 16, cfg, dtype=aj.KVDtype.FP8)
    tables = jnp.array([[5, 1, 9, 14, 2, 20], [3, 17, 0, 8, 11, 6]], jnp.int32)
    x = jax.random.normal(jax.random.key(1), (2, 40, 256))
    _, cache = aj.attention.prefill(params, x, cache, tables, jnp.zeros(2, jnp.int32),
                                    lengths=jnp.array([40, 23]))
    x = jax.random.normal(jax.random.key(2), (2, q_len, 256))
    seq = jnp.array([40, 23]) + q_len
    want, _ = aj.attention.decode(params, x, cache, tables, seq, kernels=XLA)
    got, _ = aj.attention.decode(params, x, cache, tables, seq,
                                 kernels=PALLAS.replace(attn_decode_kernel="mosaic"))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3
