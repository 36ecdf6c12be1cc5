"""MoE layer: routers against a naive per-token numpy loop, moe_forward against the same loop,
decode == prefill, jit == eager, token isolation, shapes and errors."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import atlas_jax as aj
from atlas_jax.config import Activation, Format, GateUpLayout, MoEConfig, RouterScoring
from atlas_jax.quant import dequantize

H, I, E = 64, 32, 8

ROUTERS = {
    "qwen3": dict(),
    "qwen3_nonorm": dict(norm_topk_prob=False),
    "mixtral_scaled": dict(routed_scaling_factor=2.5),
    "deepseek_v3": dict(scoring="sigmoid", selection_bias=True, n_group=4, topk_group=2,
                        norm_eps=1e-20, routed_scaling_factor=2.5, top_k=3,
                        shared_intermediate_size=32),
    "minimax_m2": dict(scoring="sigmoid", selection_bias=True),
    "deepseek_v4": dict(scoring="sqrt_softplus", selection_bias=True, norm_eps=1e-20,
                        routed_scaling_factor=1.5, swiglu_limit=0.5, shared_intermediate_size=32),
    "deepseek_v4_hash": dict(scoring="sqrt_softplus", hash_vocab_size=50, norm_eps=1e-20,
                             routed_scaling_factor=1.5),
    "longcat": dict(selection_bias=True, norm_topk_prob=False, num_zero_experts=3, top_k=4,
                    routed_scaling_factor=3.0),
    "gpt_oss": dict(scoring="topk_softmax", router_bias=True, activation="gpt_oss",
                    swiglu_limit=0.5, gate_up_layout="interleaved", expert_bias=True),
    "gemma4": dict(gemma_router=True, per_expert_scale=True, pre_expert_norm=True,
                   activation="gelu_tanh"),
    "qwen2_shared": dict(shared_intermediate_size=48, shared_expert_gate=True,
                         norm_topk_prob=False),
    "bf16_router": dict(router_dtype="bfloat16"),
}


def make(name, fmt=Format.BF16, dtype=jnp.float32, seed=0, **extra):
    kw = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2)
    kw.update(ROUTERS[name])
    kw.update(extra)
    cfg = MoEConfig(expert_format=fmt, **kw)
    return aj.moe.init_params(jax.random.key(seed), cfg, dtype=dtype)


def tokens(t, seed=1, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), (t, H), jnp.float32).astype(dtype)


def token_ids_for(params, t, seed=2):
    if not params.config.hash_routing:
        return None
    return jax.random.randint(jax.random.key(seed), (t,), 0, params.config.hash_vocab_size)


# ---------------------------------------------------------------------------------------------
# naive per-token numpy reference (float64)
# ---------------------------------------------------------------------------------------------


def np_f(a):
    return None if a is None else np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def bf16(a):
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32),
                      np.float64)


def naive_route_token(p, x, tid):
    """One token: returns (ids, weights) following the HF definitions literally."""
    cfg = p.config
    xr = x
    if cfg.gemma_router:
        xr = x / np.sqrt(np.mean(x * x) + cfg.rms_norm_eps) * np_f(p.router_scale) * H**-0.5
    w_router = np_f(p.router)
    if cfg.router_dtype == "bfloat16":  # operands and logits rounded to bf16, as the layer does
        xr, w_router = bf16(xr), bf16(w_router)
    logits = w_router @ xr
    if cfg.router_dtype == "bfloat16":
        logits = bf16(logits)
    if p.router_bias is not None:
        logits = logits + np_f(p.router_bias)
    k = cfg.top_k
    if cfg.scoring is RouterScoring.TOPK_SOFTMAX:
        ids = np.argsort(-logits, kind="stable")[:k]
        w = np.exp(logits[ids] - logits[ids].max())
        w = w / w.sum()
    else:
        if cfg.scoring is RouterScoring.SOFTMAX:
            s = np.exp(logits - logits.max())
            s = s / s.sum()
        elif cfg.scoring is RouterScoring.SIGMOID:
            s = 1 / (1 + np.exp(-logits))
        else:
            s = np.sqrt(np.log1p(np.exp(logits)))
        if cfg.hash_routing:
            ids = np.asarray(p.tid2eid)[tid]
        else:
            c = s + (np_f(p.selection_bias) if p.selection_bias is not None else 0)
            if cfg.n_group > 1:
                g = c.reshape(cfg.n_group, -1)
                gs = np.sort(g, axis=1)[:, -2:].sum(1)
                keep = np.argsort(-gs, kind="stable")[: cfg.topk_group]
                mask = np.zeros(cfg.n_group, bool)
                mask[keep] = True
                c = np.where(np.repeat(mask, g.shape[1]), c, 0.0)
            ids = np.argsort(-c, kind="stable")[:k]
        w = s[ids]
        if cfg.norm_topk_prob:
            w = w / (w.sum() + cfg.norm_eps)
    w = w * cfg.routed_scaling_factor
    if p.per_expert_scale is not None:
        w = w * np_f(p.per_expert_scale)[ids]
    return ids, w


def naive_act(h, cfg, interleaved):
    gate, up = (h[0::2], h[1::2]) if interleaved else np.split(h, 2)
    lim = cfg.swiglu_limit
    if cfg.activation is Activation.GPT_OSS:
        gate = np.minimum(gate, lim)
        up = np.clip(up, -lim, lim)
        return (up + 1) * gate / (1 + np.exp(-1.702 * gate))
    if cfg.activation is Activation.GELU_TANH:
        return 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3))) * up
    if lim is not None:
        gate = np.minimum(gate, lim)
        up = np.clip(up, -lim, lim)
    return gate / (1 + np.exp(-gate)) * up


def naive_moe(p, x, token_ids=None):
    cfg = p.config
    x = np_f(x)
    gu, dn = np_f(dequantize(p.gate_up)), np_f(dequantize(p.down))
    interleaved = cfg.gate_up_layout is GateUpLayout.INTERLEAVED
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        tid = None if token_ids is None else int(token_ids[t])
        ids, w = naive_route_token(p, x[t], tid)
        xe = x[t]
        if p.pre_expert_norm is not None:
            xe = x[t] / np.sqrt(np.mean(x[t] ** 2) + cfg.rms_norm_eps) * np_f(p.pre_expert_norm)
        for e, wt in zip(ids, w, strict=True):
            if e >= cfg.num_experts:
                out[t] += wt * x[t]
                continue
            h = gu[e] @ xe
            if p.gate_up_bias is not None:
                h = h + np_f(p.gate_up_bias)[e]
            y = dn[e] @ naive_act(h, cfg, interleaved)
            if p.down_bias is not None:
                y = y + np_f(p.down_bias)[e]
            out[t] += wt * y
        if p.shared_gate_up is not None:
            sgu, sdn = np_f(dequantize(p.shared_gate_up)), np_f(dequantize(p.shared_down))
            y = sdn @ naive_act(sgu @ xe, cfg, False)
            if p.shared_gate is not None:
                y = y / (1 + np.exp(-(np_f(p.shared_gate)[0] @ xe)))
            out[t] += y
    return out


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_router_matches_naive_loop(name):
    p = make(name)
    x = tokens(13)
    tids = token_ids_for(p, 13)
    r = aj.moe.route(p, x, token_ids=tids)
    chex.assert_shape([r.expert_ids, r.weights], (13, p.config.top_k))
    chex.assert_type([r.expert_ids, r.weights], [jnp.int32, jnp.float32])
    for t in range(13):
        ids, w = naive_route_token(p, np_f(x[t]), None if tids is None else int(tids[t]))
        got = dict(zip(np.asarray(r.expert_ids[t]).tolist(), np.asarray(r.weights[t]),
                       strict=True))
        assert set(got) == set(ids.tolist()), (t, got, ids)
        np.testing.assert_allclose([got[i] for i in ids], w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(set(ROUTERS) - {"deepseek_v4_hash"}))
@pytest.mark.parametrize("t", [1, 13])
def test_pallas_router_equals_xla_router(name, t):
    """``KernelConfig.router``: the Pallas router (interpret mode on CPU) routes as XLA's."""
    p = make(name)
    x = tokens(t)
    want = aj.moe.route(p, x, kernels=aj.KernelConfig(router="xla"))
    got = aj.moe.route(p, x, kernels=aj.KernelConfig(router="pallas"))
    np.testing.assert_array_equal(got.expert_ids, want.expert_ids)
    np.testing.assert_allclose(got.weights, want.weights, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("router", ["xla", "pallas"])
def test_router_at_decode_size_picks_k_distinct_experts(router):
    """Qwen3-30B-A3B's router (H 2048, E 128, k 8) at 8 tokens: k distinct ids a token, those
    of ``jax.lax.top_k`` on the logits. On the H200, XLA fused the router matmul's split-K sum
    into the rank top-k's comparisons, recomputed it per use not bit-identically, and picked
    expert 0 twice (fixed by materializing the values first)."""
    from atlas_jax.moe.routing import router_logits

    cfg = MoEConfig(hidden_size=2048, intermediate_size=16, num_experts=128, top_k=8)
    p = aj.moe.init_params(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(1), (8, 2048), jnp.bfloat16)
    fn = jax.jit(lambda p, x: aj.moe.route(p, x, kernels=aj.KernelConfig(router=router)))
    ids = np.asarray(fn(p, x).expert_ids)
    assert all(len(set(row)) == 8 for row in ids), ids
    want = jax.lax.top_k(jax.jit(router_logits)(p, x), 8)[1]
    np.testing.assert_array_equal(ids, want)


@pytest.mark.parametrize("router_dtype", ["float32", "bfloat16"])
def test_router_logits_row_sum_equals_the_matmul(router_dtype, monkeypatch):
    """Few tokens take the router matmul as a multiply + row sum, the router bias one more
    column of it; both forms agree (the bf16 router: to a bf16 ulp, where the two f32 sums
    round across a bf16 boundary)."""
    from atlas_jax.moe import routing

    p = make("gpt_oss", router_dtype=router_dtype)
    assert p.router_bias is not None
    x = tokens(5)
    rows = routing.router_logits(p, x)
    assert 5 * p.router.size <= routing.ROUTER_REDUCE_MAX_PRODUCTS
    monkeypatch.setattr(routing, "ROUTER_REDUCE_MAX_PRODUCTS", 0)
    gemm = routing.router_logits(p, x)
    tol = 1e-6 if router_dtype == "float32" else 8e-3
    np.testing.assert_allclose(rows, gemm, rtol=tol, atol=tol)


@pytest.mark.parametrize("bound", [0, 1 << 40], ids=["matmul", "row_sum"])
def test_router_logits_with_bias_round_once(bound, monkeypatch):
    """A bf16 router with a bias rounds ``x W^T + b`` to bf16 once, as ``F.linear``, on both
    paths: inputs whose sums are exact in f32 (small integers) and fractional biases
    give the float64 result rounded once, bit for bit (the matmul path had rounded the
    products, then the sum with the bias: a bf16 ulp off for some logits)."""
    from atlas_jax.moe import routing

    p = make("gpt_oss", router_dtype="bfloat16")
    rng = np.random.default_rng(0)
    e, h = p.router.shape
    w = rng.integers(-64, 65, (e, h)).astype(np.float64)
    b = rng.integers(-64, 65, e) / 64.0
    x = rng.integers(-3, 4, (7, h)).astype(np.float64)
    p = dataclasses.replace(p, router=jnp.asarray(w, jnp.bfloat16),
                            router_bias=jnp.asarray(b, jnp.bfloat16))
    monkeypatch.setattr(routing, "ROUTER_REDUCE_MAX_PRODUCTS", bound)
    got = np.asarray(routing.router_logits(p, jnp.asarray(x, jnp.bfloat16)))
    want = np.asarray(jnp.asarray(x @ w.T + b, jnp.float32).astype(jnp.bfloat16), np.float32)
    assert np.median(np.abs(x @ w.T)) > 256  # logits whose bf16 ulp is >= 2: the bias
    np.testing.assert_array_equal(got, want)  # fractions round away on a second rounding


@pytest.mark.parametrize("shape,k", [((1, 128), 8), ((13, 64), 6), ((5, 8, 32), 2),
                                     ((3, 16), 16), ((300, 128), 8)])
def test_top_k_equals_lax_top_k(shape, k):
    """The routers' ``top_k`` (pairwise ranks for small inputs; the 300-token case is past the
    bound and sorts) gives ``jax.lax.top_k``'s values and indices: ties (values drawn from a
    few levels) in index order, +-0, +-inf and the smallest subnormals ordered."""
    from atlas_jax.moe.routing import PAIRWISE_TOPK_MAX, top_k

    rng = np.random.default_rng(sum(shape) + k)
    levels = np.array([-np.inf, -1.5, -0.0, 0.0, 1e-45, 0.25, 0.25, 3.0, np.inf], np.float32)
    v = np.where(rng.random(shape) < 0.5, rng.choice(levels, shape),
                 rng.standard_normal(shape)).astype(np.float32)
    vals, ids = jax.jit(top_k, static_argnums=1)(jnp.asarray(v), k)
    ref_vals, ref_ids = jax.lax.top_k(jnp.asarray(v), k)
    assert ids.dtype == jnp.int32
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(vals, ref_vals)
    assert (v.size * shape[-1] > PAIRWISE_TOPK_MAX) == (shape[0] == 300)
    with pytest.raises(ValueError, match="k=17 must lie in"):
        top_k(jnp.zeros((2, 16)), 17)


@pytest.mark.parametrize("name", sorted(ROUTERS))
@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_moe_forward_matches_naive_loop(name, path):
    p = make(name)
    x = tokens(11)
    tids = token_ids_for(p, 11)
    y = aj.moe_forward(p, x, token_ids=tids, kernels=aj.KernelConfig(moe_path=path))
    chex.assert_shape(y, x.shape)
    chex.assert_type(y, jnp.float32)
    chex.assert_tree_all_finite(y)
    assert rel_err(y, naive_moe(p, x, tids)) < 1e-5


@pytest.mark.parametrize("fmt", list(Format))
def test_formats_decode_equals_prefill(fmt):
    p = make("deepseek_v3", fmt=fmt, dtype=jnp.bfloat16)
    x = tokens(9, dtype=jnp.bfloat16)
    yd = aj.moe_forward(p, x, kernels=aj.KernelConfig(moe_path="decode"))
    yp = aj.moe_forward(p, x, kernels=aj.KernelConfig(moe_path="prefill"))
    chex.assert_type([yd, yp], jnp.bfloat16)
    assert rel_err(yd, yp) < 1e-2
    assert rel_err(yp, naive_moe(p, x)) < 2e-2  # bf16 operands, f32 accumulation


def test_jit_equals_eager_and_batched_shapes():
    p = make("qwen3")
    x = tokens(12).reshape(3, 4, H)
    eager = aj.moe_forward(p, x)
    jitted = jax.jit(aj.moe_forward)(p, x)
    chex.assert_shape(jitted, (3, 4, H))
    np.testing.assert_allclose(eager, jitted, rtol=1e-5, atol=1e-6)
    flat = aj.moe_forward(p, x.reshape(12, H))
    np.testing.assert_allclose(flat.reshape(3, 4, H), eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["qwen3", "longcat", "deepseek_v4_hash"])
def test_few_tokens_agree_with_batch(name):
    p = make(name)
    x = tokens(16)
    tids = token_ids_for(p, 16)
    full = aj.moe_forward(p, x, token_ids=tids, kernels=aj.KernelConfig(moe_path="prefill"))
    for n in (1, 2, 3):
        part = aj.moe_forward(p, x[:n], token_ids=None if tids is None else tids[:n])
        np.testing.assert_allclose(part, full[:n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_nan_token_is_isolated(path):
    p = make("deepseek_v3")
    x = tokens(6)
    clean = aj.moe_forward(p, x, kernels=aj.KernelConfig(moe_path=path))
    dirty = aj.moe_forward(p, x.at[2].set(jnp.nan), kernels=aj.KernelConfig(moe_path=path))
    keep = np.array([0, 1, 3, 4, 5])
    np.testing.assert_array_equal(np.asarray(dirty)[keep], np.asarray(clean)[keep])


def test_all_tokens_one_expert_and_repeated_experts():
    p = make("qwen3")
    x = tokens(10)
    p = dataclasses.replace(p, router=p.router.at[5].set(x.sum(0) * 10))  # favour expert 5
    r = aj.moe.route(p, x)
    assert int((r.expert_ids == 5).sum()) >= 8
    for path in ("prefill", "decode"):
        y = aj.moe_forward(p, x, kernels=aj.KernelConfig(moe_path=path))
        assert rel_err(y, naive_moe(p, x)) < 1e-5


def test_empty_input_returns_empty():
    p = make("qwen3")
    for shape in [(0, H), (2, 0, H)]:
        y = aj.moe_forward(p, jnp.zeros(shape))
        chex.assert_shape(y, shape)


def test_bad_inputs_raise():
    p = make("qwen3")
    with pytest.raises(ValueError, match=r"last dim must be hidden_size=64, got 32"):
        aj.moe_forward(p, jnp.ones((3, 32)))
    with pytest.raises(ValueError, match=r"x must be \[T, H\] or \[B, S, H\]"):
        aj.moe_forward(p, jnp.ones((H,)))
    with pytest.raises(TypeError, match="floating point"):
        aj.moe_forward(p, jnp.ones((3, H), jnp.int32))
    with pytest.raises(TypeError, match="params must be MoEParams"):
        aj.moe_forward({"router": 1}, jnp.ones((3, H)))


def test_hash_routing_errors():
    p = make("deepseek_v4_hash")
    x = tokens(4)
    with pytest.raises(ValueError, match="hash-routing layer .* pass token_ids"):
        aj.moe.route(p, x)
    with pytest.raises(ValueError, match=r"token_ids: 1 value\(s\) outside \[0, 50\)"):
        aj.moe.route(p, x, token_ids=jnp.array([1, 2, 50, 3]))
    with pytest.raises(ValueError, match="token_ids must be 4 integers"):
        aj.moe.route(p, x, token_ids=jnp.array([1, 2]))
    with pytest.raises(Exception, match=r"outside \[0, 50\)"):  # under jit: at run time
        jax.jit(aj.moe.route)(p, x, jnp.array([1, 2, -1, 3])).weights.block_until_ready()


def test_params_validation():
    p = make("qwen3")
    with pytest.raises(ValueError, match=r"MoEParams.router: expected shape \(8, 64\)"):
        dataclasses.replace(p, router=jnp.ones((7, H)))
    with pytest.raises(ValueError, match=r"MoEParams.selection_bias: the config does not use it"):
        dataclasses.replace(p, selection_bias=jnp.ones((E,)))
    with pytest.raises(ValueError, match=r"MoEParams.router_bias: the config needs shape"):
        dataclasses.replace(p, config=p.config.replace(router_bias=True))


def test_config_change_retraces_only_then():
    traces = []

    @jax.jit
    def f(p, x):
        traces.append(1)
        return aj.moe_forward(p, x)

    x = tokens(4)
    f(make("qwen3", seed=0), x)
    f(make("qwen3", seed=3), x)
    assert len(traces) == 1
    f(make("qwen3_nonorm"), x)
    assert len(traces) == 2
