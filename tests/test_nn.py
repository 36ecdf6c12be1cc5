"""Flax NNX modules equal the pure functions they wrap."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import atlas_jax as aj
from atlas_jax import nn

FIXTURES = Path(__file__).parent / "fixtures"


def test_moe_module_equals_function():
    cfg = aj.MoEConfig(hidden_size=64, intermediate_size=32, num_experts=8, top_k=2,
                       expert_format="nvfp4", shared_intermediate_size=32)
    m = nn.MoE(cfg, rngs=nnx.Rngs(0))
    assert m.config == cfg
    x = jax.random.normal(jax.random.key(1), (5, 64), jnp.bfloat16)
    want = aj.moe_forward(m.params.get_value(), x)
    np.testing.assert_array_equal(m(x), want)
    np.testing.assert_array_equal(nnx.jit(lambda mod, x: mod(x))(m, x), want)
    graph, state = nnx.split(m)
    np.testing.assert_array_equal(nnx.merge(graph, state)(x), want)
    # Same params as the function's init with the same key.
    p = aj.moe.init_params(nnx.Rngs(0).params(), cfg)
    np.testing.assert_array_equal(aj.moe_forward(p, x), want)


def test_moe_module_from_checkpoint():
    path = FIXTURES / "moe" / "qwen2_moe_norm"
    g = np.load(path / "golden.npz")
    m = nn.MoE.from_checkpoint(path, int(g["layer"]))
    y = m(jnp.asarray(g["x"]))
    assert np.linalg.norm(y - g["y"]) / np.linalg.norm(g["y"]) < 1e-4


def test_attention_module_equals_function():
    cfg = aj.AttentionConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16)
    a = nn.Attention(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
    cache = aj.PagedKVCache.create(8, 4, cfg, dtype=aj.KVDtype.FLOAT32)
    x = jax.random.normal(jax.random.key(2), (2, 5, 64))
    tables = jnp.array([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32)
    start = jnp.zeros((2,), jnp.int32)
    y, c = a(x, cache, tables, start)
    y2, c2 = aj.attention.prefill(a.params.get_value(), x, cache, tables, start)
    np.testing.assert_array_equal(y, y2)
    xd = jax.random.normal(jax.random.key(3), (2, 1, 64))
    yd, _ = a.decode(xd, c, tables, jnp.array([6, 6], jnp.int32))
    yd2, _ = aj.attention.decode(a.params.get_value(), xd, c2, tables,
                                 jnp.array([6, 6], jnp.int32))
    np.testing.assert_array_equal(yd, yd2)


def test_attention_module_from_checkpoint():
    path = FIXTURES / "attention" / "qwen3"
    a = nn.Attention.from_checkpoint(path, 0)
    assert a.params.get_value() is not None and a.config.qk_norm


def test_constructor_errors():
    cfg = aj.MoEConfig(hidden_size=64, intermediate_size=32, num_experts=8, top_k=2)
    with pytest.raises(ValueError, match="pass cfg and rngs"):
        nn.MoE(cfg)
    with pytest.raises(TypeError, match="params must be MoEParams"):
        nn.MoE(params={"router": 1})
    p = aj.moe.init_params(jax.random.key(0), cfg)
    with pytest.raises(ValueError, match="cfg differs from params.config"):
        nn.MoE(cfg.replace(top_k=3), params=p)
    assert nn.MoE.from_params(p).config == cfg
