"""Attention over the paged KV cache.

* transformers goldens (tests/fixtures/attention, made by
  checkpoints/goldens/make_attention_goldens.py): Qwen3 QK-norm, Qwen3 + YaRN, Qwen3-Next gated
  attention with partial rotary and (1+w) norms; f32 rel. error < 1e-4 through prefill and
  through prefill + decode; RoPE tables and q/k/v/attention intermediates;
* every variant (GQA ratios, head_dim 64..512, sliding window, softcap, scale, sinks, gates,
  biases, quantized weights, RoPE styles) against a naive float64 numpy layer;
* one-shot prefill == chunked prefill == prefill + token-by-token decode == decode with
  Q = 2..4, for every KV dtype; scattered page tables; sequence isolation;
* KV dtype error bounds (per element, and per layer output vs a float32 cache);
* RoPE (neox, partial, GPT-J, mrope, linear, YaRN) against independent numpy formulas;
* every error path.

Compiling is the cost on CPU (~1-3 s per program), so tests share one config, B = 2, tables of
4 pages and a few sequence lengths wherever they can: ``prefill`` / ``decode`` compile once per
(config, shapes, KV dtype) and share the compiled step.
"""

import functools
import json
import math
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import atlas_jax.attention as A
from atlas_jax._safetensors import SafetensorsFile
from atlas_jax.attention import kv_cache, layer, norm, rope
from atlas_jax.config import (
    AttentionConfig,
    Format,
    KernelConfig,
    KVDtype,
    NormStyle,
    OutputGate,
    RopeConfig,
    RopeScaling,
    RopeStyle,
)
from atlas_jax.ops.paged_attention import paged_attention
from atlas_jax.quant import dequantize

FIXTURES = Path(__file__).parent / "fixtures" / "attention"
H, HQ, HK, D = 64, 4, 2, 16
PAGE, PT, NUM_PAGES = 4, 4, 48  # page size, table pages per sequence, pages in a cache
ALL_KV = list(KVDtype)


def cfg_of(**kw) -> AttentionConfig:
    base = dict(hidden_size=H, num_heads=HQ, num_kv_heads=HK, head_dim=D,
                rope=RopeConfig(theta=10000.0))
    return AttentionConfig(**{**base, **kw})


_init = jax.jit(A.init_params, static_argnums=1, static_argnames="dtype")  # eager: ~0.1 s/op
_dequantize = jax.jit(lambda ws: [dequantize(w) for w in ws])  # one compile for a layer


def make(seed=0, **kw) -> A.AttentionParams:
    return _init(jax.random.key(seed), cfg_of(**kw), dtype=None)


def rand_x(b, s, seed=1, h=H):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((b, s, h)), jnp.float32)


def tables_for(b, seed=0, pt=PT, num_pages=NUM_PAGES):
    """[B, Pt] distinct, shuffled page ids (never contiguous)."""
    perm = np.random.default_rng(seed).permutation(num_pages)[: b * pt]
    return jnp.asarray(perm.reshape(b, pt), jnp.int32)


def fresh(cfg, dtype=KVDtype.FLOAT32, num_pages=NUM_PAGES, page=PAGE):
    return A.PagedKVCache.create(num_pages, page, cfg, dtype=dtype)


def full(b, value):
    return jnp.full((b,), value, jnp.int32)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def np64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def run_prefill(p, x, dtype=KVDtype.FLOAT32, **kw):
    b = x.shape[0]
    return A.prefill(p, x, fresh(p.config, dtype), tables_for(b), full(b, 0), **kw)


write = jax.jit(lambda c, slots, k, v: c.write(slots, k, v))
gather = jax.jit(lambda c, t: c.gather(t))


# ---------------------------------------------------------------------------------------------
# independent numpy references (float64)
# ---------------------------------------------------------------------------------------------


def hf_yarn(theta, dim, factor, orig, beta_fast=32, beta_slow=1, mscale=None,
            mscale_all_dim=None, attention_factor=None, truncate=True):
    """transformers.modeling_rope_utils._compute_yarn_parameters, transcribed to numpy."""

    def get_mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

    def find_correction_dim(num_rotations):
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = find_correction_dim(beta_fast), find_correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (
        1.0 / pos_freqs) * extrapolation_factor
    return inv, attention_factor


def naive_inv_freq(rc: RopeConfig, head_dim):
    r = rc.rotary_dim(head_dim)
    base = rc.theta ** (-np.arange(0, r, 2, dtype=np.float64) / r)
    match rc.scaling:
        case RopeScaling.NONE:
            return base, 1.0
        case RopeScaling.LINEAR:
            return base / rc.factor, 1.0
        case RopeScaling.YARN:
            return hf_yarn(rc.theta, r, rc.factor, rc.original_max_position_embeddings,
                           rc.beta_fast, rc.beta_slow, rc.mscale, rc.mscale_all_dim,
                           rc.attention_factor, rc.truncate)


def naive_rope(x, pos, rc: RopeConfig, head_dim):
    """x [B, S, N, D] f64; pos [B, S] or [3, B, S]. Rotation of explicit index pairs."""
    r = rc.rotary_dim(head_dim)
    inv, af = naive_inv_freq(rc, head_dim)
    ang = np.asarray(pos, np.float64)[..., None] * inv
    if ang.ndim == 4:  # transformers' Qwen3VL recomposition_frequencies, literally
        thw = ang[0].copy()
        for dim, offset in enumerate((1, 2), start=1):
            length = rc.mrope_section[dim] * 3
            thw[..., offset:length:3] = ang[dim, ..., offset:length:3]
        ang = thw
    c, s = (np.cos(ang) * af)[:, :, None], (np.sin(ang) * af)[:, :, None]
    i1 = 2 * np.arange(r // 2) if rc.style is RopeStyle.GPTJ else np.arange(r // 2)
    i2 = i1 + 1 if rc.style is RopeStyle.GPTJ else i1 + r // 2
    out = x.copy()
    out[..., i1] = x[..., i1] * c - x[..., i2] * s
    out[..., i2] = x[..., i2] * c + x[..., i1] * s
    return out


def naive_layer(p: A.AttentionParams, x, pos=None):
    """Fresh prompts (positions 0..S-1 unless ``pos``), whole causal attention, float64."""
    cfg = p.config
    x = np64(x)
    b, s, _ = x.shape
    d, hq, hk = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    wq, wk, wv, wo = map(np64, _dequantize([p.q_proj, p.k_proj, p.v_proj, p.o_proj]))

    def lin(a, w, bias):
        return a @ w.T if bias is None else a @ w.T + np64(bias)

    q = lin(x, wq, p.q_bias).reshape(b, s, hq, -1)
    q, gate = q[..., :d], q[..., d:]
    k = lin(x, wk, p.k_bias).reshape(b, s, hk, d)
    v = lin(x, wv, p.v_bias).reshape(b, s, hk, d)
    if cfg.qk_norm:
        def rms(t, w):
            w = np64(w) + (1.0 if cfg.norm_style is NormStyle.OFFSET else 0.0)
            return t / np.sqrt((t * t).mean(-1, keepdims=True) + cfg.rms_norm_eps) * w
        q, k = rms(q, p.q_norm), rms(k, p.k_norm)
    if pos is None:
        pos = np.broadcast_to(np.arange(s), (b, s))
    q, k = naive_rope(q, pos, cfg.rope, d), naive_rope(k, pos, cfg.rope, d)
    g = hq // hk
    out = np.zeros((b, s, hq, d))
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    mask = j <= i
    if cfg.sliding_window:
        mask &= i - j < cfg.sliding_window
    for bi in range(b):
        for h in range(hq):
            logits = q[bi, :, h] @ k[bi, :, h // g].T * cfg.softmax_scale  # [S, S]
            if cfg.logit_softcap:
                logits = cfg.logit_softcap * np.tanh(logits / cfg.logit_softcap)
            logits = np.where(mask, logits, -np.inf)
            if p.sinks is not None:
                logits = np.concatenate([logits, np.full((s, 1), np64(p.sinks)[h])], axis=1)
            e = np.exp(logits - logits.max(1, keepdims=True))
            out[bi, :, h] = (e / e.sum(1, keepdims=True))[:, :s] @ v[bi, :, h // g]
    match cfg.output_gate:
        case OutputGate.ELEMENTWISE | OutputGate.HEADWISE_SIGMOID:
            out = out / (1 + np.exp(-gate))
        case OutputGate.HEADWISE_SOFTPLUS:
            out = out * np.log1p(np.exp(gate))
    return lin(out.reshape(b, s, -1), wo, p.o_bias)


# ---------------------------------------------------------------------------------------------
# transformers goldens
# ---------------------------------------------------------------------------------------------


GOLDENS = ["qwen3", "qwen3_yarn", "qwen3_next"]


def load_golden(name):
    folder = FIXTURES / name
    if not (folder / "golden.npz").exists():
        pytest.skip(f"fixture {folder} missing: run checkpoints/goldens/make_attention_goldens.py "
                    "in a venv with torch + transformers")
    d = json.loads((folder / "config.json").read_text())
    cfg = AttentionConfig.from_hf_config(d)
    st = SafetensorsFile(folder / "model.safetensors")
    params = A.from_hf_tensors(st.get, "model.layers.0.self_attn.", cfg)
    return params, dict(np.load(folder / "golden.npz")), d


@pytest.mark.parametrize("name", GOLDENS)
def test_golden_prefill_and_decode(name):
    """One-shot prefill of 9 tokens, and prefill 4 + decode Q=1 + decode Q=4: every output
    matches transformers' causal forward (f32 rel. error < 1e-4)."""
    p, g, d = load_golden(name)
    cfg = p.config
    assert cfg.qkv_bias == cfg.o_bias == d["attention_bias"] and cfg.qk_norm
    assert (cfg.output_gate is OutputGate.ELEMENTWISE) == (name == "qwen3_next")
    assert (cfg.norm_style is NormStyle.OFFSET) == (name == "qwen3_next")
    x = jnp.asarray(g["x"])
    b = x.shape[0]
    y, _ = run_prefill(p, x)
    assert rel(y, g["y"]) < 1e-4
    tables = tables_for(b, seed=3)
    y0, cache = A.prefill(p, x[:, :4], fresh(cfg), tables, full(b, 0))
    y1, cache = A.decode(p, x[:, 4:5], cache, tables, full(b, 5))
    y2, cache = A.decode(p, x[:, 5:9], cache, tables, full(b, 9))
    assert rel(jnp.concatenate([y0, y1, y2], 1), g["y"]) < 1e-4


_paged_attention = jax.jit(paged_attention, static_argnames="scale")


@jax.jit
def _qkv(p, x, pos):
    q, k, v, gate = layer.project_qkv(p, x)
    return *layer.qk_norm_rope(p, q, k, pos), v, gate


@pytest.mark.parametrize("name", GOLDENS)
def test_golden_intermediates(name):
    """RoPE tables, q/k after QK-norm + RoPE, v, attention before the gate, vs transformers."""
    p, g, _ = load_golden(name)
    cfg = p.config
    pos = jnp.arange(g["rope_cos"].shape[0])[None]
    cos, sin = rope.rope_cos_sin(cfg.rope, cfg.head_dim, pos)
    assert rel(jnp.concatenate([cos, cos], -1)[0], g["rope_cos"]) < 1e-5
    assert rel(jnp.concatenate([sin, sin], -1)[0], g["rope_sin"]) < 1e-5
    assert rope.inv_freq(cfg.rope, cfg.head_dim)[1] == pytest.approx(float(g["attention_scaling"]))
    x = jnp.asarray(g["x"])
    q, k, v, gate = _qkv(p, x, jnp.asarray(g["position_ids"]))
    assert (gate is not None) == (name == "qwen3_next")
    for ours, theirs in ((q, "q"), (k, "k"), (v, "v")):
        assert rel(ours.transpose(0, 2, 1, 3), g[theirs]) < 1e-5
    b, s, _ = x.shape
    cache = write(fresh(cfg), jnp.arange(b * s, dtype=jnp.int32), k.reshape(b * s, HK, -1),
                  v.reshape(b * s, HK, -1))
    # sequence 0 sits in slots 0..8 = pages 0, 1, 2
    attn = _paged_attention(q[:1], cache, jnp.array([[0, 1, 2]], jnp.int32),
                            jnp.arange(s, dtype=jnp.int32)[None], scale=cfg.softmax_scale)
    assert rel(attn.reshape(1, s, -1), g["attn"][:1]) < 1e-5


# ---------------------------------------------------------------------------------------------
# layer variants against the naive float64 layer
# ---------------------------------------------------------------------------------------------


VARIANTS = {
    "qwen3": dict(),
    "mha_gptj": dict(num_kv_heads=4, rope=RopeConfig(style="gptj", partial_rotary_factor=0.5)),
    "mqa_linear": dict(num_kv_heads=1, rope=RopeConfig(scaling="linear", factor=2.0)),
    "gqa8_head_dim_64": dict(num_heads=8, num_kv_heads=1, head_dim=64),
    "head_dim_256_yarn": dict(num_heads=2, num_kv_heads=1, head_dim=256, rope=RopeConfig(
        theta=1e6, scaling="yarn", factor=4.0, original_max_position_embeddings=4)),
    "head_dim_512": dict(num_heads=2, num_kv_heads=1, head_dim=512),
    "no_qk_norm_biases_fp8_weights": dict(qk_norm=False, qkv_bias=True, o_bias=True,
                                          weight_format="fp8_block", fp8_block=(32, 32)),
    "window_softcap_scale": dict(sliding_window=3, logit_softcap=2.0, scale=0.5),
    "sinks_biases": dict(sinks=True, qkv_bias=True, o_bias=True),
    "gated_next": dict(output_gate="elementwise", norm_style="offset", head_dim=32,
                       rope=RopeConfig(theta=1e7, partial_rotary_factor=0.25)),
    "headwise_sigmoid_nvfp4_weights": dict(output_gate="headwise_sigmoid", weight_format="nvfp4"),
    "headwise_softplus_mxfp4_weights": dict(output_gate="headwise_softplus",
                                            weight_format="mxfp4"),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_matches_naive(name):
    p = make(**VARIANTS[name])
    x = rand_x(2, 7)
    y, _ = run_prefill(p, x)
    chex.assert_shape(y, x.shape)
    assert rel(y, naive_layer(p, x)) < 1e-5


def test_mrope_3d_positions():
    p = make(rope=RopeConfig(style="mrope", mrope_section=(2, 3, 3), theta=1e4))
    x = rand_x(2, 7)
    pos = np.random.default_rng(5).integers(0, 50, (3, 2, 7))
    y, _ = run_prefill(p, x, positions=jnp.asarray(pos, jnp.int32))
    assert rel(y, naive_layer(p, x, pos)) < 1e-5
    y, _ = run_prefill(p, x)  # text only: positions [B, S], all three axes equal
    assert rel(y, naive_layer(p, x)) < 1e-5


def test_bf16_activations():
    p = _init(jax.random.key(0), cfg_of(), dtype=jnp.bfloat16)
    x = rand_x(2, 7).astype(jnp.bfloat16)
    y, _ = run_prefill(p, x, dtype=KVDtype.BF16)
    assert y.dtype == jnp.bfloat16
    assert rel(y, naive_layer(p, x)) < 3e-2


def test_jit_equals_eager_and_compiles_once():
    p = make()
    x = rand_x(2, 7)
    t = tables_for(2)
    y, c = A.prefill(p, x, fresh(p.config), t, full(2, 0))
    traces = []

    @jax.jit
    def step(p, x, cache, tables, start):
        traces.append(1)
        return A.prefill(p, x, cache, tables, start)

    yj, cj = step(p, x, fresh(p.config), t, full(2, 0))
    np.testing.assert_allclose(y, yj, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(c, cj, rtol=1e-6, atol=1e-6)
    step(p, x + 1, cj, t, jnp.array([7, 3], jnp.int32))
    assert len(traces) == 1


# ---------------------------------------------------------------------------------------------
# prefill / chunked prefill / decode equivalences, page tables, isolation
# ---------------------------------------------------------------------------------------------


EQUIV = {
    "qwen3": dict(),
    "next_sinks_window": dict(output_gate="elementwise", norm_style="offset", sinks=True,
                              sliding_window=5, rope=RopeConfig(partial_rotary_factor=0.5)),
}
# Shapes used below (B = 2, S in 12, 4, 3, 2, 1): each compiles once per config and KV dtype.


@pytest.mark.parametrize("name", EQUIV)
def test_one_shot_chunked_decode_agree(name):
    """One-shot prefill of 12 tokens == chunked prefill 4 + 4 + 4 (start_pos > 0) ==
    prefill 2 + decode Q=1, 1, then Q=2, 3, 4 (MTP verify: causal among the Q)."""
    p = make(**EQUIV[name])
    x = rand_x(2, 12, seed=7)
    t = tables_for(2, seed=1)
    one, c_one = A.prefill(p, x, fresh(p.config), t, full(2, 0))
    cache, ys = fresh(p.config), []
    for lo in (0, 4, 8):
        y, cache = A.prefill(p, x[:, lo:lo + 4], cache, t, full(2, lo))
        ys.append(y)
    np.testing.assert_allclose(jnp.concatenate(ys, 1), one, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(cache, c_one, rtol=1e-6, atol=1e-6)
    y, cache = A.prefill(p, x[:, :2], fresh(p.config), t, full(2, 0))
    ys, lo = [y], 2
    for q in (1, 2, 3, 4):
        y, cache = A.decode(p, x[:, lo:lo + q], cache, t, full(2, lo + q))
        ys.append(y)
        lo += q
    np.testing.assert_allclose(jnp.concatenate(ys, 1), one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv", [KVDtype.BF16, KVDtype.FP8, KVDtype.NVFP4])
def test_quantized_cache_write_order_independent(kv):
    """Per-token KV scales make every write order store the same bits: one-shot prefill ==
    chunked prefill == prefill + decode Q=4 steps, cache included, for every KV dtype."""
    p = make()
    x = rand_x(2, 12, seed=7)
    t = tables_for(2, seed=1)
    one, c_one = A.prefill(p, x, fresh(p.config, kv), t, full(2, 0))
    y0, cache = A.prefill(p, x[:, :4], fresh(p.config, kv), t, full(2, 0))
    y1, cache = A.prefill(p, x[:, 4:8], cache, t, full(2, 4))
    y2, cache = A.decode(p, x[:, 8:], cache, t, full(2, 12))
    ys = [y0, y1, y2]
    np.testing.assert_allclose(jnp.concatenate(ys, 1), one, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_equal(cache.k.map(lambda a: a[t]), c_one.k.map(lambda a: a[t]))
    chex.assert_trees_all_equal(cache.v.map(lambda a: a[t]), c_one.v.map(lambda a: a[t]))


def test_sequences_of_different_lengths():
    """A ragged batch (prefill lengths 3 and 9, then one decode step of Q=2 at seq_lens 5 and
    11) equals each sequence alone."""
    p = make()
    lens = [3, 9]
    t = tables_for(2, seed=2)
    x = rand_x(2, 12)
    _, cache = A.prefill(p, x, fresh(p.config), t, full(2, 0), lengths=jnp.array(lens))
    xq = jnp.stack([x[i, n:n + 2] for i, n in enumerate(lens)])
    y, _ = A.decode(p, xq, cache, t, jnp.array(lens) + 2)
    for i, n in enumerate(lens):  # sequence i alone: row i of a batch whose other row is empty
        alone, _ = A.prefill(p, x, fresh(p.config), t, full(2, 0),
                             lengths=jnp.array([n + 2, 0][:: 1 - 2 * i]))
        np.testing.assert_allclose(y[i], alone[i, n:n + 2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("page", [1, 3, 8])
def test_page_tables_do_not_change_the_result(page):
    p = make()
    x = rand_x(2, 7)
    pt = -(-7 // page) + 1
    contiguous = jnp.arange(2 * pt, dtype=jnp.int32).reshape(2, pt)
    scattered = tables_for(2, seed=page, pt=pt, num_pages=20)
    y1, _ = A.prefill(p, x, fresh(p.config, num_pages=20, page=page), contiguous, full(2, 0))
    y2, _ = A.prefill(p, x, fresh(p.config, num_pages=20, page=page), scattered, full(2, 0))
    np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-6)
    assert rel(y1, naive_layer(p, x)) < 1e-5


def test_ragged_prefill_writes_only_real_tokens():
    p = make()
    x = rand_x(2, 4)
    t = tables_for(2)
    y, cache = A.prefill(p, x, fresh(p.config), t, full(2, 0), lengths=jnp.array([4, 2]))
    np.testing.assert_array_equal(y[1, 2:], 0)
    y_full, c_full = A.prefill(p, x, fresh(p.config), t, full(2, 0))
    np.testing.assert_allclose(y[1, :2], y_full[1, :2], rtol=1e-5, atol=1e-6)
    slot = np.asarray(t[1, 0]) * PAGE + 2  # sequence 1, position 2: not written
    assert not np.asarray(cache.k.data.reshape(-1, HK, D)[slot]).any()
    assert np.asarray(c_full.k.data.reshape(-1, HK, D)[slot]).any()


def test_sequences_isolated():
    """Changing sequence 0's tokens (or writing more of it) never changes sequence 1's output
    or pages, and pages outside the tables never change."""
    p = make()
    t = tables_for(2, seed=4)
    x = rand_x(2, 12)
    x_other = x.at[0].set(rand_x(1, 12, seed=99)[0])
    y, c = A.prefill(p, x, fresh(p.config, KVDtype.FP8), t, full(2, 0))
    y2, c2 = A.prefill(p, x_other, fresh(p.config, KVDtype.FP8), t, full(2, 0))
    np.testing.assert_array_equal(y[1], y2[1])
    assert not np.allclose(y[0], y2[0])
    chex.assert_trees_all_equal(c.k.map(lambda a: a[t[1]]), c2.k.map(lambda a: a[t[1]]))
    untouched = np.setdiff1d(np.arange(NUM_PAGES), np.asarray(t).ravel())
    chex.assert_trees_all_equal(c.v.map(lambda a: a[untouched]),
                                fresh(p.config, KVDtype.FP8).v.map(lambda a: a[untouched]))
    # 4 more tokens of sequence 0 alone leave sequence 1's next 4 tokens unchanged
    xn = rand_x(2, 4, seed=5)
    only = functools.partial(A.prefill, p, xn, block_tables=t, start_pos=full(2, 12))
    _, c3 = only(cache=c, lengths=jnp.array([4, 0]))
    y_a, _ = only(cache=c, lengths=jnp.array([0, 4]))
    y_b, _ = only(cache=c3, lengths=jnp.array([0, 4]))
    np.testing.assert_array_equal(y_a, y_b)


def test_shared_prefix_pages_may_be_read():
    """Two sequences may share a read-only prefix page (prefix cache); both continue from it."""
    p = make()
    x = rand_x(2, 7)
    x = x.at[1, :4].set(x[0, :4])  # same 4-token prefix
    t = jnp.array([[7, 3, 11, 12], [7, 9, 13, 14]], jnp.int32)  # page 7 = positions 0..3
    prefix_only = t.at[1].set(jnp.array([20, 21, 22, 23], jnp.int32))
    _, cache = A.prefill(p, x[:, :4], fresh(p.config), prefix_only, full(2, 0),
                         lengths=jnp.array([4, 0]))
    y, _ = A.prefill(p, x[:, 4:], cache, t, full(2, 4))
    ref, _ = run_prefill(p, x)
    np.testing.assert_allclose(y, ref[:, 4:], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# KV cache: layout, slot mapping, quantization error bounds, FP8 calibration
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv", ALL_KV)
def test_cache_layout(kv):
    n, pg = 5, 3
    c = A.PagedKVCache.create(n, pg, cfg_of(), dtype=kv)
    data, scale, glob = {
        KVDtype.FLOAT32: (((n, pg, HK, D), jnp.float32), None, None),
        KVDtype.BF16: (((n, pg, HK, D), jnp.bfloat16), None, None),
        KVDtype.FP8: (((n, pg, HK, D), jnp.float8_e4m3fn), ((n, pg, HK), jnp.float32), None),
        KVDtype.NVFP4: (((n, pg, HK, D // 2), jnp.uint8),
                        ((n, pg, HK, D // 16), jnp.float8_e4m3fn), ((n, pg, HK), jnp.float32)),
    }[kv]
    for pages in (c.k, c.v):
        for arr, want in ((pages.data, data), (pages.scale, scale), (pages.global_scale, glob)):
            assert (arr is None) == (want is None)
            if want is not None:
                assert (arr.shape, arr.dtype) == want
    assert (c.num_pages, c.page_size, c.num_kv_heads, c.head_dim) == (n, pg, HK, D)
    assert c.fp8_amax is None and c.calibration_tokens == 0
    k, v = gather(c, jnp.array([[0, 4]], jnp.int32))
    chex.assert_shape(k, (1, 2 * pg, HK, D))
    np.testing.assert_array_equal(k, 0)


def test_slot_mapping():
    t = jnp.array([[5, 2, 9], [1, 0, 3]], jnp.int32)
    pos = jnp.array([[0, 3, 4, 11], [-1, 5, 7, 12]], jnp.int32)
    np.testing.assert_array_equal(A.slot_mapping(t, pos, 4), [[20, 23, 8, 39], [-1, 1, 3, -1]])
    np.testing.assert_array_equal(fresh(cfg_of()).slot_mapping(t, pos), [[20, 23, 8, 39],
                                                                         [-1, 1, 3, -1]])


def test_write_and_gather_round_trip():
    c = fresh(cfg_of(), num_pages=6)
    k = jnp.asarray(np.random.default_rng(0).standard_normal((3, HK, D)), jnp.float32)
    c2 = write(c, jnp.array([5, -1, 22], jnp.int32), k, -k)  # -1 is skipped
    kk, vv = gather(c2, jnp.array([[1, 5]], jnp.int32))  # slots 4..7, 20..23
    np.testing.assert_array_equal(kk[0, 1], k[0])
    np.testing.assert_array_equal(vv[0, 6], -k[2])
    changed = np.nonzero(np.any(np.asarray(c2.k.data != c.k.data), axis=(2, 3)).ravel())[0]
    np.testing.assert_array_equal(changed, [5, 22])


def test_paged_attention_padding_and_sinks():
    """A padding query (q_pos -1) gives 0, with or without sinks; a sink alone takes its share
    of the softmax: one visible key with logit l and sink s gives v * e^l / (e^l + e^s)."""
    c = write(fresh(cfg_of()), jnp.array([0], jnp.int32), jnp.ones((1, HK, D)),
              jnp.full((1, HK, D), 3.0))
    q = jnp.ones((1, 2, HQ, D)) / D  # logit q.k * scale = 1 * 0.5
    pos = jnp.array([[0, -1]], jnp.int32)
    t = jnp.array([[0]], jnp.int32)
    out = _paged_attention(q, c, t, pos, scale=0.5)
    np.testing.assert_allclose(out[0, 0], 3.0, rtol=1e-6)
    np.testing.assert_array_equal(out[0, 1], 0)
    sinks = jnp.full((HQ,), 0.5)  # equal to the logit: half the weight
    out = jax.jit(paged_attention, static_argnames="scale")(q, c, t, pos, scale=0.5, sinks=sinks)
    np.testing.assert_allclose(out[0, 0], 1.5, rtol=1e-6)
    np.testing.assert_array_equal(out[0, 1], 0)
    # slots no query sees may hold junk (NaN), and unused table entries any id
    poisoned = write(c, jnp.arange(1, 8, dtype=jnp.int32), jnp.full((7, HK, D), jnp.nan),
                     jnp.full((7, HK, D), jnp.nan))
    out = _paged_attention(q, poisoned, jnp.array([[0, 1, -5]], jnp.int32), pos, scale=0.5)
    np.testing.assert_allclose(out[0, 0], 3.0, rtol=1e-6)


@pytest.mark.parametrize("kv", ALL_KV)
def test_kv_quantization_error_per_element(kv):
    """Stated bounds, per element x of a token-head vector with amax a:
    BF16 |e| <= 2^-8 |x|; FP8 (scale s = a/448) |e| <= 2^-4 |x| + 2^-10 s (3 mantissa bits, and
    E4M3's subnormal step 2^-9 s); NVFP4 |e| <= 0.18 * amax of its 16-block + 2^-10 a/448
    (E2M1's largest half-step is 1 of 6 at the block max, and the E4M3 block scale rounds by
    <= 2^-4)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, HK, D)) * np.exp(2 * rng.standard_normal((64, HK, 1)))
    x = jnp.asarray(x, jnp.float32)  # magnitudes over ~e^+-6
    err = np.abs(np64(jax.jit(lambda x: kv_cache.quantize_tokens(x, kv).dequantize())(x))
                 - np64(x))
    ax = np.abs(np64(x))
    amax = ax.max(-1, keepdims=True)
    match kv:
        case KVDtype.FLOAT32:
            assert err.max() == 0
        case KVDtype.BF16:
            assert (err <= 2**-8 * ax).all()
        case KVDtype.FP8:
            assert (err <= 2**-4 * ax + 2**-10 * amax / 448).all()
            assert (err / amax).max() > 0.01  # it does round
        case KVDtype.NVFP4:
            block_amax = np.repeat(ax.reshape(64, HK, -1, 16).max(-1), 16, axis=-1)
            assert (err <= 0.18 * block_amax + 2**-10 * amax / 448).all()


# Stated bounds of the layer output vs a float32 cache (max-norm relative error, random data).
KV_OUTPUT_BOUND = {KVDtype.BF16: 1e-2, KVDtype.FP8: 5e-2, KVDtype.NVFP4: 2e-1}


@pytest.mark.parametrize("kv", [KVDtype.BF16, KVDtype.FP8, KVDtype.NVFP4])
def test_kv_dtype_output_error_bounds(kv):
    p = make()
    x = rand_x(2, 12, seed=7)
    ref, _ = run_prefill(p, x)
    y, _ = run_prefill(p, x, dtype=kv)
    err = rel(y, ref)
    assert KV_OUTPUT_BOUND[kv] / 100 < err < KV_OUTPUT_BOUND[kv]  # rounds, within the bound


def test_fp8_calibration():
    """fp8_kv_calibration_tokens=N: per-head amax over the first N tokens written, then frozen;
    later larger values saturate at +-448 * amax/448."""
    c = fresh(cfg_of(fp8_kv_calibration_tokens=5), KVDtype.FP8)
    assert c.calibration_tokens == 5 and int(c.fp8_seen) == 0
    k = jnp.asarray(np.random.default_rng(0).standard_normal((8, HK, D)), jnp.float32)
    # write 1: 3 tokens + 1 padding slot; write 2: 4 tokens, of which the first 2 calibrate
    c = write(c, jnp.array([0, 1, -1, 2], jnp.int32), k[:4], 2 * k[:4])
    assert int(c.fp8_seen) == 3
    amax3 = np.abs(np64(k[jnp.array([0, 1, 3])])).max((0, 2))
    np.testing.assert_allclose(c.fp8_amax[0], amax3, rtol=1e-7)
    c = write(c, jnp.arange(3, 7, dtype=jnp.int32), k[4:], 2 * k[4:])
    amax5 = np.abs(np64(k[jnp.array([0, 1, 3, 4, 5])])).max((0, 2))
    np.testing.assert_allclose(c.fp8_amax[0], amax5, rtol=1e-7)
    np.testing.assert_allclose(c.fp8_amax[1], 2 * amax5, rtol=1e-7)
    assert int(c.fp8_seen) == 5
    scale = c.k.scale.reshape(-1, HK)
    np.testing.assert_allclose(scale[3:7], np.broadcast_to(amax5 / 448, (4, HK)), rtol=1e-6)
    # frozen: a large token saturates at the calibrated amax
    big = 10 * jnp.abs(k[:1]) + 10
    c = write(c, jnp.array([7], jnp.int32), big, big)
    np.testing.assert_allclose(c.fp8_amax[0], amax5, rtol=1e-7)
    kk, _ = gather(c, jnp.array([[0, 1]], jnp.int32))
    np.testing.assert_allclose(kk[0, 7], np.broadcast_to(amax5[:, None], (HK, D)), rtol=1e-6)


def test_fp8_calibrated_layer_close_to_f32():
    p = make()
    p_cal = make(fp8_kv_calibration_tokens=16)  # same weights (same key), calibrated FP8 KV
    x = rand_x(2, 12, seed=7)
    ref, _ = run_prefill(p, x)
    y, c = run_prefill(p_cal, x, dtype=KVDtype.FP8)
    assert rel(y, ref) < 5e-2
    assert int(c.fp8_seen) == 16


# ---------------------------------------------------------------------------------------------
# RoPE and norms against numpy formulas
# ---------------------------------------------------------------------------------------------


YARN_CASES = {
    "qwen3_yarn": dict(theta=1e6, factor=4.0, original_max_position_embeddings=32768),
    "gpt_oss": dict(theta=150000.0, factor=32.0, original_max_position_embeddings=4096,
                    truncate=False),
    "deepseek_mscale": dict(theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                            mscale=1.0, mscale_all_dim=0.8),
    "override": dict(theta=1e6, factor=2.0, original_max_position_embeddings=64,
                     attention_factor=1.5, beta_fast=16.0, beta_slow=2.0),
    "partial": dict(theta=1e7, factor=8.0, original_max_position_embeddings=256,
                    partial_rotary_factor=0.25),
}


@pytest.mark.parametrize("name", YARN_CASES)
def test_yarn_inv_freq_and_attention_factor(name):
    rc = RopeConfig(scaling="yarn", **YARN_CASES[name])
    inv, af = rope.inv_freq(rc, 128)
    ref_inv, ref_af = naive_inv_freq(rc, 128)
    assert inv.dtype == np.float32 and inv.shape == ref_inv.shape
    np.testing.assert_allclose(inv, ref_inv, rtol=1e-6)
    assert af == pytest.approx(ref_af, rel=1e-12)


ROPES = {
    "neox": RopeConfig(theta=1e4),
    "neox_partial": RopeConfig(theta=1e7, partial_rotary_factor=0.25),
    "gptj": RopeConfig(style="gptj"),
    "gptj_partial": RopeConfig(style="gptj", partial_rotary_factor=0.5),
    "linear": RopeConfig(scaling="linear", factor=4.0),
    "yarn": RopeConfig(scaling="yarn", factor=4.0, original_max_position_embeddings=64),
    "mrope": RopeConfig(style="mrope", mrope_section=(8, 12, 12)),
}


@functools.partial(jax.jit, static_argnums=2)
def _rope(x, pos, rc):
    cos, sin = rope.rope_cos_sin(rc, x.shape[-1], pos)
    return rope.apply_rope(x, cos, sin, rc.style), cos


def test_rope_against_numpy():
    rng = np.random.default_rng(0)
    d = 64
    x = jnp.asarray(rng.standard_normal((2, 5, 3, d)), jnp.float32)
    for name, rc in ROPES.items():
        shape = (3, 2, 5) if rc.style is RopeStyle.MROPE else (2, 5)
        pos = rng.integers(0, 300, shape)
        y, cos = _rope(x, jnp.asarray(pos, jnp.int32), rc)
        r = rc.rotary_dim(d)
        assert cos.shape == (2, 5, r // 2), name
        np.testing.assert_allclose(y, naive_rope(np64(x), pos, rc, d), atol=2e-4, err_msg=name)
        np.testing.assert_array_equal(y[..., r:], x[..., r:])


def test_mrope_axes():
    np.testing.assert_array_equal(rope.mrope_axes((2, 3, 3), 8), [0, 1, 2, 0, 1, 2, 0, 1])
    np.testing.assert_array_equal(rope.mrope_axes((24, 20, 20), 64)[:6], [0, 1, 2, 0, 1, 2])
    assert (rope.mrope_axes((24, 20, 20), 64)[60:] == 0).all()


@pytest.mark.parametrize("style", list(NormStyle))
def test_rms_norm(style):
    rng = np.random.default_rng(0)
    x = jnp.asarray(3 * rng.standard_normal((3, 5, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(32), jnp.float32)
    y = norm.rms_norm(x, w, 1e-6, style)
    xn = np64(x)
    wn = np64(w) + (1.0 if style is NormStyle.OFFSET else 0.0)
    ref = xn / np.sqrt((xn**2).mean(-1, keepdims=True) + 1e-6) * wn
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    assert norm.rms_norm(x.astype(jnp.bfloat16), w, 1e-6, style).dtype == jnp.bfloat16
    r = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    y2, res = norm.add_rms_norm(x, r, w, 1e-6, style)
    np.testing.assert_array_equal(res, x + r)
    np.testing.assert_allclose(y2, norm.rms_norm(x + r, w, 1e-6, style), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# params
# ---------------------------------------------------------------------------------------------


def stored_linear(qt) -> dict[str, np.ndarray]:
    """A [N, K] QTensor as a checkpoint stores it: {tensor suffix: array}."""
    match qt.format:
        case Format.BF16:
            return {"weight": np.asarray(qt.data)}
        case Format.FP8_BLOCK:
            return {"weight": np.asarray(qt.data), "weight_scale_inv": np.asarray(qt.scale)}
        case Format.NVFP4:  # ModelOpt
            return {"weight": np.asarray(qt.data), "weight_scale": np.asarray(qt.scale),
                    "weight_scale_2": np.asarray(qt.global_scale)[0]}
        case Format.MXFP4:  # gpt-oss blocks
            return {"weight_blocks": np.asarray(qt.data).reshape(qt.shape[0], -1, 16),
                    "weight_scales": np.asarray(qt.scale)}


@pytest.mark.parametrize("fmt", [Format.FP8_BLOCK, Format.NVFP4, Format.MXFP4])
def test_from_hf_tensors_quantized(fmt):
    """Each stored format loads as stored (told apart by the tensors present)."""
    cfg = cfg_of(weight_format=fmt, fp8_block=(32, 32), qkv_bias=True)
    p = _init(jax.random.key(0), cfg, dtype=None)
    pre = "layers.0.self_attn."
    tensors = {}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        tensors.update({f"{pre}{name}.{t}": a for t, a in stored_linear(getattr(p, name)).items()})
    for name in ("q", "k", "v"):
        tensors[f"{pre}{name}_proj.bias"] = np.asarray(getattr(p, f"{name}_bias"))
    tensors[f"{pre}q_norm.weight"] = np.asarray(p.q_norm)
    tensors[f"{pre}k_norm.weight"] = np.asarray(p.k_norm)
    loaded = A.from_hf_tensors(tensors.__getitem__, pre, cfg)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, loaded), jax.tree.map(np.asarray, p))


def test_init_params_shapes():
    cfg = cfg_of(output_gate="headwise_sigmoid", sinks=True, qkv_bias=True)
    p = _init(jax.random.key(0), cfg, dtype=jnp.bfloat16)
    assert p.q_proj.shape == (HQ * (D + 1), H) and p.q_bias.shape == (HQ * (D + 1),)
    assert p.sinks.shape == (HQ,) and p.o_bias is None
    assert p.q_proj.data.dtype == jnp.bfloat16
    assert cfg_of(output_gate="elementwise").q_proj_rows == 2 * HQ * D


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


def _inputs():
    """B=2, S=3 tokens, tables of 4 pages of 4 (capacity 16)."""
    p = make()
    return p, rand_x(2, 3), fresh(p.config), tables_for(2)


def test_shape_errors_at_trace_time():
    p, x, c, t = _inputs()
    z = full(2, 0)
    cases = [
        (lambda: A.prefill(p, x[0], c, t, z), ValueError, r"x must be \[B, S, H\]"),
        (lambda: A.prefill(p, x[..., :32], c, t, z), ValueError, "H=hidden_size=64"),
        (lambda: A.prefill(p, x.astype(jnp.int32), c, t, z), TypeError, "floating"),
        (lambda: A.prefill(p, x, c, t[:1], z), ValueError, r"block_tables must be \[B=2, Pt\]"),
        (lambda: A.prefill(p, x, c, t.astype(jnp.float32), z), TypeError, "integer page"),
        (lambda: A.prefill(p, x, c, t, full(3, 0)), ValueError, r"start_pos must be \[B=2\]"),
        (lambda: A.prefill(p, x, c, t, jnp.zeros(2)), TypeError, "start_pos must be integer"),
        (lambda: A.prefill(p, rand_x(2, 17), c, t, z), ValueError,
         r"S=17 tokens a sequence, more than the block table holds \(4 pages x 4 = 16\)"),
        (lambda: A.decode(p, rand_x(2, 5), c, t, full(2, 5)), ValueError,
         r"Q in 1..4 .* got Q=5"),
        (lambda: A.decode(p, rand_x(2, 0), c, t, z), ValueError, "got Q=0"),
        (lambda: A.decode(p, x[:, :1], c, t, full(1, 1)), ValueError,
         r"seq_lens must be \[B=2\]"),
        (lambda: A.prefill(p, x, fresh(cfg_of(num_kv_heads=1)), t, z), ValueError,
         "cache holds 1 kv heads of dim 16, the config 2"),
        (lambda: A.prefill("p", x, c, t, z), TypeError, "params must be AttentionParams"),
        (lambda: A.prefill(p, x, c.k, t, z), TypeError, "cache must be a PagedKVCache"),
        (lambda: A.prefill(p, x, c, t, z, positions=z), ValueError,
         "positions must be one of shapes"),
        (lambda: A.prefill(p, x, c, t, z, positions=jnp.zeros((3, 2, 3), jnp.int32)),
         ValueError, "positions must be one of shapes"),
        (lambda: A.prefill(p, x, c, t, z, lengths=full(1, 1)), ValueError,
         r"lengths must be \[B=2\]"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()


def test_value_errors_eager():
    p, x, c, t = _inputs()
    z = full(2, 0)
    cases = [
        (lambda: A.decode(p, x[:, :1], c, t, jnp.array([17, 3])),
         r"seq_lens: sequence 0 covers positions \[16, 17\), outside the block table's "
         r"capacity \[0, 16\)"),
        (lambda: A.decode(p, x, c, t, jnp.array([2, 5])), r"seq_lens: must count .* \(>= 3\)"),
        (lambda: A.prefill(p, x, c, t, jnp.array([0, 14])),
         r"start_pos: sequence 1 covers positions \[14, 17\)"),
        (lambda: A.prefill(p, x, c, t, jnp.array([-1, 0])), r"positions \[-1, 2\)"),
        (lambda: A.prefill(p, x, c, t.at[1, 0].set(NUM_PAGES), z),
         r"sequence 1 uses page id 48, expected ids in \[0, 48\)"),
        (lambda: A.prefill(p, x, c, t.at[1, 0].set(-1), z), "uses page id -1"),
        (lambda: A.prefill(p, x, c, t.at[1, 0].set(t[0, 0]), z),
         r"sequence 0 writes page\(s\) \[\d+\] that sequence 1 also uses"),
        (lambda: A.prefill(p, rand_x(2, 8), c, t.at[0, 1].set(t[0, 0]), z),
         "sequence 0 lists a page twice"),
        (lambda: A.prefill(p, x, c, t, z, lengths=jnp.array([4, 1])),
         r"lengths: expected values in \[0, S=3\]"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    # an unused table entry may hold anything (here -1): only used entries are checked
    A.prefill(p, x, c, t.at[:, 1].set(-1), z)


def test_value_errors_under_jit():
    """Under jit the same checks run from a host callback and fail the computation."""
    p, x, c, t = _inputs()
    step = jax.jit(A.decode)
    with pytest.raises(Exception, match=r"outside the block table's capacity"):
        jax.block_until_ready(step(p, x[:, :1], c, t, jnp.array([17, 3], jnp.int32)))
    with pytest.raises(Exception, match=r"uses page id 99"):
        jax.block_until_ready(step(p, x[:, :1], c, t.at[0, 0].set(99), full(2, 1)))


def test_backend_choice():
    p, x, c, t = _inputs()
    y, _ = A.prefill(p, x, c, t, full(2, 0), kernels=KernelConfig(paged_attention="xla"))
    y2, _ = A.prefill(p, x, c, t, full(2, 0))  # auto without a GPU: the reference
    np.testing.assert_array_equal(y, y2)
    with pytest.raises(NotImplementedError, match="head_dim 16: the Pallas kernels tile D"):
        A.prefill(p, x, c, t, full(2, 0), kernels=KernelConfig(paged_attention="pallas"))


def test_prefill_pallas_equals_xla():
    """The Pallas prefill kernel (interpret mode) == the reference, for a ragged prompt batch
    (the second row's last token is padding); the cache written is the same either way."""
    p = make(head_dim=64)
    x, t = rand_x(2, 5), tables_for(2)
    lens = jnp.array([5, 4])
    want, c1 = A.prefill(p, x, fresh(p.config), t, full(2, 0), lengths=lens,
                         kernels=KernelConfig(paged_attention="xla"))
    got, c2 = A.prefill(p, x, fresh(p.config), t, full(2, 0), lengths=lens,
                        kernels=KernelConfig(paged_attention="pallas"))
    assert rel(got, want) < 1e-4  # float32 pages: f32 dots in the kernel
    jax.tree.map(np.testing.assert_array_equal, c1, c2)


@pytest.mark.parametrize("kv", [KVDtype.BF16, KVDtype.NVFP4])
def test_fresh_cache_can_be_donated(kv):
    """K and V of a new cache are separate buffers: a jitted write may donate the cache."""
    cfg = cfg_of()
    c = A.PagedKVCache.create(4, 4, cfg, dtype=kv)
    new = jax.random.normal(jax.random.key(0), (2, 3, cfg.num_kv_heads, cfg.head_dim))
    write = jax.jit(lambda c, s, k, v: c.write(s, k, v), donate_argnums=0)
    c = write(c, jnp.array([0, 5, 9], jnp.int32), new[0], new[1])
    k, v = c.gather(jnp.array([[0, 1, 2]], jnp.int32))
    assert not np.array_equal(np.asarray(k), np.asarray(v))


def test_cache_and_params_errors():
    cfg = cfg_of()
    with pytest.raises(ValueError, match="NVFP4 KV needs head_dim a multiple of 16, got 24"):
        A.PagedKVCache.create(4, 4, cfg_of(head_dim=24), dtype=KVDtype.NVFP4)
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        A.PagedKVCache.create(4, 0, cfg)
    with pytest.raises(ValueError, match="dtype must be one of"):
        A.PagedKVCache.create(4, 4, cfg, dtype="int8")
    with pytest.raises(TypeError, match="cfg must be an AttentionConfig"):
        A.PagedKVCache.create(4, 4, {"head_dim": 16})
    assert A.PagedKVCache.create(4, 4, cfg, dtype="fp8").dtype is KVDtype.FP8
    p = make()
    w = (p.q_proj, p.k_proj, p.v_proj, p.o_proj)
    with pytest.raises(ValueError, match=r"AttentionParams.q_norm: the config needs shape \(16,\)"):
        A.AttentionParams(*w, config=cfg)
    with pytest.raises(ValueError, match="AttentionParams.sinks: the config does not use it"):
        A.AttentionParams(*w, q_norm=p.q_norm, k_norm=p.k_norm, sinks=jnp.zeros(HQ), config=cfg)
    with pytest.raises(ValueError, match=r"AttentionParams.q_proj: expected shape \(128, 64\)"):
        A.AttentionParams(*w, q_norm=p.q_norm, k_norm=p.k_norm,
                          config=cfg_of(output_gate="elementwise"))
    with pytest.raises(ValueError, match="config says format nvfp4"):
        A.AttentionParams(*w, q_norm=p.q_norm, k_norm=p.k_norm,
                          config=cfg_of(weight_format="nvfp4"))
    with pytest.raises(TypeError, match="config must be an AttentionConfig"):
        A.AttentionParams(*w, q_norm=p.q_norm, k_norm=p.k_norm)
    with pytest.raises(NotImplementedError, match="q_proj.weight is float8_e4m3fn without "
                                                  "q_proj.weight_scale_inv"):
        A.from_hf_tensors({"q_proj.weight": np.zeros((HQ * D, H), jnp.float8_e4m3fn)}.__getitem__,
                          "", cfg)
    with pytest.raises(ValueError, match=r"PagedKVCache.write: expected slots \[T\] and k, v"):
        fresh(cfg).write(jnp.zeros((2,), jnp.int32), jnp.zeros((2, HK, 8)), jnp.zeros((2, HK, 8)))
    with pytest.raises(ValueError, match=r"paged_attention: q_pos must be \[1, 2\]"):
        paged_attention(jnp.zeros((1, 2, HQ, D)), fresh(cfg), jnp.zeros((1, 1), jnp.int32),
                        jnp.zeros((1, 1), jnp.int32), scale=1.0)


def test_empty_batch():
    p = make()
    c = fresh(p.config)
    y, c2 = A.prefill(p, rand_x(0, 3), c, jnp.zeros((0, 2), jnp.int32), full(0, 0))
    chex.assert_shape(y, (0, 3, H))
    assert c2 is c
