"""The Pallas router (``pallas_kernels.routing``; interpret mode on CPU) against its plain-jnp
reference and ``jax.lax.top_k``: every scoring rule, selection bias, groups, per-expert scales,
token counts that are not multiples of the program's block, ties, +-0, +-inf and NaN, errors;
its Triton lowering for the H200; compiled on a GPU where one is present."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._device import abstract_gpu
from pallas_kernels.routing import RouterRule, block_tokens, route, route_reference

ON_GPU = jax.devices()[0].platform == "gpu"
INTERPRET = not ON_GPU

RULES = {
    "qwen3": RouterRule("softmax", 8, normalize=True),
    "mixtral": RouterRule("softmax", 2),
    "longcat": RouterRule("softmax", 12, scale=6.0),  # E + Z outputs: zero experts selectable
    "gpt_oss": RouterRule("topk_softmax", 4),
    "deepseek_v3": RouterRule("sigmoid", 8, normalize=True, norm_eps=1e-20, scale=2.5,
                              n_group=8, topk_group=4),
    "minimax": RouterRule("sigmoid", 8, normalize=True),
    "deepseek_v4": RouterRule("sqrt_softplus", 6, normalize=True, norm_eps=1e-20, scale=1.5),
}


def logits_for(t, e, seed=0):
    return jax.random.normal(jax.random.key(seed), (t, e), jnp.float32) * 2.0


def run(logits, rule, bias=None, scale=None):
    return route(logits, rule, bias, scale, interpret=INTERPRET)


def assert_routes_equal(got, want):
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("name, t, e, bias, scale", [
    ("qwen3", 1, 128, False, False),
    ("qwen3", 8, 128, False, False),
    ("qwen3", 37, 128, False, False),  # 19 programs of 2, the last one part-filled
    ("mixtral", 5, 8, False, True),
    ("longcat", 3, 768, True, False),  # 512 experts + 256 zero experts, one token a program
    ("gpt_oss", 9, 32, False, False),
    ("gpt_oss", 2, 128, False, False),
    ("deepseek_v3", 4, 256, True, False),
    ("deepseek_v3", 19, 64, True, False),
    ("minimax", 3, 40, True, False),  # 40 outputs: padded to 64 columns, 2 tokens a program
    ("deepseek_v4", 6, 24, True, True),
])
def test_router_equals_reference(name, t, e, bias, scale):
    rule = RULES[name]
    key = jax.random.key(t * 1000 + e)
    b = jax.random.normal(key, (e,)) * 0.2 if bias else None
    s = jax.random.uniform(jax.random.fold_in(key, 1), (e,)) + 0.5 if scale else None
    got = run(logits_for(t, e, seed=t + e), rule, b, s)
    assert got[0].shape == got[1].shape == (t, rule.k)
    assert got[0].dtype == jnp.int32 and got[1].dtype == jnp.float32
    assert_routes_equal(got, route_reference(logits_for(t, e, seed=t + e), rule, b, s))
    ids = np.asarray(got[0])
    assert all(len(set(row)) == rule.k for row in ids)  # k distinct ids a token
    assert ids.min() >= 0 and ids.max() < e


@pytest.mark.parametrize("scoring", ["softmax", "topk_softmax", "sigmoid"])
def test_ties_and_special_values_follow_lax_top_k(scoring):
    """Values drawn from a few levels (ties, +-0, +-inf, the smallest subnormal): the ids are
    ``jax.lax.top_k``'s, ties to the lower index."""
    rng = np.random.default_rng(3)
    levels = np.array([-np.inf, -1.5, -0.0, 0.0, 1e-45, 0.25, 3.0, np.inf], np.float32)
    t, e = 11, 48
    v = np.where(rng.random((t, e)) < 0.7, rng.choice(levels, (t, e)),
                 rng.standard_normal((t, e))).astype(np.float32)
    if scoring != "topk_softmax":  # softmax / sigmoid of +-inf rows: keep the scores finite
        v = np.where(np.isinf(v), np.sign(v) * 30.0, v).astype(np.float32)
    rule = RouterRule(scoring, 6)
    ids, w = run(jnp.asarray(v), rule)
    want_ids, want_w = route_reference(jnp.asarray(v), rule)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=2e-6, atol=1e-7)


def test_nan_logits_give_valid_distinct_ids():
    """A NaN logit ranks above +inf (IEEE total order, as XLA's rank top-k): the ids stay k
    distinct in-range experts; the NaN shows in that token's weights, not elsewhere."""
    v = logits_for(4, 16)
    v = v.at[1, 5].set(jnp.nan)
    ids, w = run(v, RULES["gpt_oss"])
    ids = np.asarray(ids)
    assert ids[1, 0] == 5
    assert all(len(set(row)) == 4 for row in ids) and ids.min() >= 0 and ids.max() < 16
    assert np.isnan(np.asarray(w)[1]).all() and np.isfinite(np.asarray(w)[[0, 2, 3]]).all()


def test_no_tokens_and_bad_input():
    ids, w = route(jnp.zeros((0, 8)), RULES["mixtral"], interpret=True)
    assert ids.shape == w.shape == (0, 2)
    with pytest.raises(ValueError, match=r"logits: expected float \[T, E\]"):
        route(jnp.zeros((8,)), RULES["mixtral"], interpret=True)
    with pytest.raises(ValueError, match=r"RouterRule.k: 8 must be <= the 4 router outputs"):
        route(jnp.ones((2, 4)), RULES["qwen3"], interpret=True)
    with pytest.raises(ValueError, match=r"selection_bias: expected shape \(8,\)"):
        route(jnp.ones((2, 8)), RULES["mixtral"], jnp.ones(7), interpret=True)
    with pytest.raises(ValueError, match="groups must split the 30 router outputs"):
        route(jnp.ones((2, 30)), RULES["deepseek_v3"], interpret=True)
    with pytest.raises(ValueError, match="topk_group: 5 must be <= n_group 4"):
        RouterRule("sigmoid", 2, n_group=4, topk_group=5)
    with pytest.raises(ValueError, match="Scoring: expected one of"):
        RouterRule("relu", 2)


def test_block_tokens():
    assert [block_tokens(t, e) for t, e in [(1, 128), (8, 128), (64, 128), (64, 256), (4, 768),
                                            (64, 8192), (3, 32)]] == [1, 2, 2, 1, 1, 1, 4]


@pytest.mark.parametrize("name, t, e", [("qwen3", 8, 128), ("deepseek_v3", 64, 256),
                                        ("gpt_oss", 4096, 128), ("longcat", 3, 768)])
def test_router_lowers_to_triton_for_h200(name, t, e):
    sd = jax.ShapeDtypeStruct
    rule = RULES[name]

    def f(logits, bias):
        return route(logits, rule, bias)

    with abstract_gpu():
        lowered = jax.jit(f).trace(sd((t, e), jnp.float32), sd((e,), jnp.float32)).lower(
            lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 1


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled router")
@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("t", [1, 8, 64, 4096])
def test_compiled_router_on_gpu(name, t):
    e = {"longcat": 768, "deepseek_v3": 256, "gpt_oss": 128}.get(name, 128)
    rule = RULES[name]
    logits = logits_for(t, e, seed=t)
    b = jax.random.normal(jax.random.key(5), (e,)) * 0.2
    got = jax.jit(route, static_argnames="rule")(logits, rule, b)
    assert_routes_equal(got, jax.jit(route_reference, static_argnums=1)(logits, rule, b))
