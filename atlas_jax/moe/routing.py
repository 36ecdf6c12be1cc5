"""Routers: pure functions from router logits to (expert ids, weights), one per scoring rule.

Semantics follow Hugging Face transformers 5.x for each architecture:

- softmax (Qwen2/3-MoE, Mixtral, LongCat, Gemma-4): fp32 softmax over all router outputs,
  top-k on score (+ selection bias), weights = unbiased scores, renormalised if configured.
- sigmoid (DeepSeek-V3, MiniMax-M2): sigmoid scores; selection on score + bias, optionally
  group-limited (groups scored by the sum of their top-2; non-selected groups' choices set to 0);
  weights = unbiased scores, renormalised (+eps).
- sqrt-softplus (DeepSeek-V4): sqrt(softplus(logit)) scores, selection bias, renormalised (+eps),
  or the ids come from a hash table indexed by token id.
- top-k-then-softmax (gpt-oss): top-k on the logits, softmax over the k selected.

Every rule ends with ``weights *= routed_scaling_factor`` (and Gemma-4's per-expert scale).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from atlas_jax import ops
from atlas_jax._checks import check_in_range
from atlas_jax.config import Backend, KernelConfig, MoEConfig, RouterScoring
from atlas_jax.moe.params import MoEParams


class Routing(NamedTuple):
    expert_ids: jax.Array  # [T, k] int32; ids >= num_experts are zero (identity) experts
    weights: jax.Array  # [T, k] float32


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """Weightless RMSNorm in float32."""  # [..., H] -> [..., H] f32
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


# Up to this many products (T x E x H) the router matmul is a multiply and a row sum: one XLA
# reduction fusion reading the router weight once from HBM, each further token re-reading it
# from L2 (hence a bound on T x the weight, not on T). As a GEMM, XLA on the H200 ran a split-K
# GEMM plus a partial-sum fusion every decode step (Qwen3-30B-A3B at 8 tokens: 3.3 + 1.2 us)
# and, where H is no multiple of its K block, two pad fusions first (gpt-oss-120b's H = 2880:
# 1.3 + 1.8 us); the row sum measured 4.4 / 4.7 us with the router kernel at 8 tokens (routing
# alone, was 6.1 / 10.0). Inside full NVFP4 decode steps (H200, session 28) the row sum also
# won past the first bound (6M products): Qwen3 32 / 64 tokens 4.6 / 6.8 us against 5.4 + 1.5
# / 6.8 + 1.6 (busy step 121.4 -> 119.2 / 135.3 -> 131.7 us), gpt-oss 32 tokens 8.6 us in one
# launch against 12.7 in five (452.5 -> 447.4), though alone, outside a step, XLA's GEMM is
# the faster from 16 tokens. The bound takes Qwen3 up to 64 tokens, gpt-oss up to 45,
# DeepSeek-V3 (E 256, H 7168) up to 9 (not measured past 3).
ROUTER_REDUCE_MAX_PRODUCTS = 1 << 24


def router_logits(params: MoEParams, x: jax.Array) -> jax.Array:
    """Router logits in the config's router dtype, returned as float32."""  # [T, H] -> [T, E+Z]
    cfg = params.config
    dtype = jnp.dtype(cfg.router_dtype)
    if cfg.gemma_router:
        x = rms_normalize(x, cfg.rms_norm_eps) * params.router_scale.astype(jnp.float32)
        x = x * cfg.hidden_size**-0.5
    xs, w = x.astype(dtype), params.router.astype(dtype)
    bias = None if params.router_bias is None else params.router_bias.astype(dtype)
    if x.shape[0] * w.size <= ROUTER_REDUCE_MAX_PRODUCTS:  # f32 products (exact for bf16)
        xf, wf = xs.astype(jnp.float32), w.astype(jnp.float32)
        if bias is not None:  # one more column (x: 1, w: the bias), in the one reduction
            # fusion (an add after it was a launch of its own) and rounded once, as F.linear
            xf = jnp.concatenate([xf, jnp.ones((xf.shape[0], 1), jnp.float32)], axis=1)
            wf = jnp.concatenate([wf, bias.astype(jnp.float32)[:, None]], axis=1)
            bias = None
        logits = jnp.sum(xf[:, None, :] * wf[None], axis=-1).astype(dtype)
    else:
        # float32 routers at full float32 precision (XLA's GPU default would take TF32:
        # weights ~1e-4 off transformers' fp32 router on the H200)
        precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
        logits = jnp.einsum("th,eh->te", xs, w, preferred_element_type=jnp.float32,
                            precision=precision)
        if bias is not None:  # added in f32 and rounded once with the products, as F.linear
            logits = logits + bias.astype(jnp.float32)
        logits = logits.astype(dtype)
    return logits.astype(jnp.float32)


# -- scoring rules: logits [T, E] f32 -> scores [T, E] f32 --------------------------------------


def softmax_scores(logits: jax.Array) -> jax.Array:
    return jax.nn.softmax(logits, axis=-1)


def sigmoid_scores(logits: jax.Array) -> jax.Array:
    return jax.nn.sigmoid(logits)


def sqrt_softplus_scores(logits: jax.Array) -> jax.Array:
    return jnp.sqrt(jax.nn.softplus(logits))


# -- selection: choice scores [T, E] -> ids [T, k] ----------------------------------------------

# Up to this many comparisons (elements x last-axis length) ``top_k`` ranks by pairwise compares
# (two small XLA reductions); above it, ``jax.lax.top_k`` (a sort on the GPU: 3.2 us of a 45 us
# Qwen3-30B-A3B one-token decode step on the H200, the largest of its small kernels).
PAIRWISE_TOPK_MAX = 1 << 22


def top_k(values: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k`` over the last axis of float32 ``values``: (the k largest values in
    descending order, their int32 indices), equal values in increasing index order. Small
    inputs by rank: each element's rank is the number of elements above it (or equal to it at
    a lower index), on int32 keys in IEEE total order (NaN above +inf, -0 below +0), and the
    k lowest ranks are picked out by masked integer sums -- the same values (bit for bit) and
    indices as the sort for every non-NaN input, and no sort launch."""
    e = values.shape[-1]
    if not 0 <= k <= e:
        raise ValueError(f"top_k: k={k} must lie in [0, {e}] (the last axis' length)")
    if values.size * e > PAIRWISE_TOPK_MAX:
        vals, ids = jax.lax.top_k(values, k)
        return vals, ids.astype(jnp.int32)
    # Materialized first: fused into the comparisons, XLA on the GPU recomputed the values (the
    # router matmul's split-K sum) per use, not bit-identically, so ranks repeated and went
    # missing (duplicate ids, expert 0 picked twice; H200, Qwen3-30B-A3B at 8 tokens).
    values = jax.lax.optimization_barrier(values.astype(jnp.float32))
    bits = jax.lax.bitcast_convert_type(values, jnp.int32)
    key = jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # [..., E], ordered as the floats
    idx = jnp.arange(e, dtype=jnp.int32)
    above = (key[..., None, :] > key[..., :, None]) | (
        (key[..., None, :] == key[..., :, None]) & (idx[None, :] < idx[:, None]))
    rank = jnp.sum(above.astype(jnp.int32), axis=-1)  # [..., E]: 0 for the largest
    pick = rank[..., None, :] == jnp.arange(k, dtype=jnp.int32)[:, None]  # [..., k, E]
    ids = jnp.sum(jnp.where(pick, idx, 0), axis=-1)
    # the picked values' bits (an integer sum: no flush of subnormals, -0 stays -0)
    vals = jnp.sum(jnp.where(pick, bits[..., None, :], 0), axis=-1)
    return jax.lax.bitcast_convert_type(vals, jnp.float32), ids


def select_topk(choice: jax.Array, k: int) -> jax.Array:
    return top_k(choice, k)[1]


def select_group_limited(choice: jax.Array, k: int, n_group: int, topk_group: int) -> jax.Array:
    """DeepSeek-V3 group-limited top-k: keep the ``topk_group`` groups with the largest sum of
    their top-2 choice scores; other experts' choice scores become 0 (as transformers does)."""
    t, e = choice.shape
    grouped = choice.reshape(t, n_group, e // n_group)  # [T, G, E/G]
    group_scores = top_k(grouped, 2)[0].sum(-1)  # [T, G]
    keep = top_k(group_scores, topk_group)[1]  # [T, topk_group]
    group_mask = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], keep].set(True)
    masked = jnp.where(group_mask[:, :, None], grouped, 0.0).reshape(t, e)
    return select_topk(masked, k)


def hash_expert_ids(tid2eid: jax.Array, token_ids: jax.Array) -> jax.Array:
    """Expert ids from the hash table (DeepSeek-V4 hash layers)."""  # [V, k], [T] -> [T, k]
    check_in_range(token_ids, tid2eid.shape[0], "token_ids", "the hash table's vocabulary")
    return jnp.take(tid2eid, token_ids, axis=0).astype(jnp.int32)


# -- the router ----------------------------------------------------------------------------------


def _finish(scores: jax.Array, ids: jax.Array, params: MoEParams,
            chosen: jax.Array | None = None) -> Routing:
    """Gather unbiased scores of the chosen ids (``chosen``: already gathered), renormalise,
    scale."""
    cfg = params.config
    weights = jnp.take_along_axis(scores, ids, axis=-1) if chosen is None else chosen
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + cfg.norm_eps)
    return _scale(Routing(ids, weights), params)


def _scale(r: Routing, params: MoEParams) -> Routing:
    cfg = params.config
    weights = r.weights * cfg.routed_scaling_factor
    if params.per_expert_scale is not None:
        weights = weights * jnp.take(params.per_expert_scale.astype(jnp.float32), r.expert_ids)
    return Routing(r.expert_ids, weights.astype(jnp.float32))


def route_logits(params: MoEParams, logits: jax.Array, token_ids: jax.Array | None = None
                 ) -> Routing:
    """Routing from precomputed float32 logits ``[T, E+Z]``."""
    cfg = params.config
    k = cfg.top_k
    if cfg.scoring is RouterScoring.TOPK_SOFTMAX:
        values, ids = top_k(logits, k)
        return _scale(Routing(ids, jax.nn.softmax(values, axis=-1)), params)
    score_fn = {
        RouterScoring.SOFTMAX: softmax_scores,
        RouterScoring.SIGMOID: sigmoid_scores,
        RouterScoring.SQRT_SOFTPLUS: sqrt_softplus_scores,
    }[cfg.scoring]
    scores = score_fn(logits)
    if cfg.hash_routing:
        return _finish(scores, hash_expert_ids(params.tid2eid, token_ids), params)
    choice = scores
    if params.selection_bias is not None:
        choice = scores + params.selection_bias.astype(jnp.float32)
    if cfg.n_group > 1:
        ids = select_group_limited(choice, k, cfg.n_group, cfg.topk_group)
    elif params.selection_bias is None:  # top-k values are the chosen scores: no gather
        values, ids = top_k(scores, k)
        return _finish(scores, ids, params, values)
    else:
        ids = select_topk(choice, k)
    return _finish(scores, ids, params)


def route(params: MoEParams, x: jax.Array, token_ids: jax.Array | None = None, *,
          kernels: KernelConfig | None = None) -> Routing:
    """Route tokens: ``x [T, H]`` (or [B, S, H], flattened) -> Routing of ``[T, k]``.

    ``kernels.router`` picks the selection's implementation (``ops.router_backend``): this
    module's ``route_logits`` ("xla") or the Pallas router ("pallas"; "auto" on a GPU)."""
    cfg = params.config
    x2 = check_tokens(x, cfg)
    token_ids = check_token_ids(token_ids, cfg, x2.shape[0])
    logits = router_logits(params, x2)
    if ops.router_backend(cfg, kernels) is Backend.PALLAS:
        return Routing(*ops.route_pallas(logits, cfg, params.selection_bias,
                                         params.per_expert_scale))
    return route_logits(params, logits, token_ids)


def check_token_ids(token_ids, cfg: MoEConfig, num_tokens: int) -> jax.Array | None:
    """Hash-routing layers need one integer token id per token: validated, flattened to [T]."""
    if not cfg.hash_routing:
        return token_ids
    if token_ids is None:
        raise ValueError("route: this is a hash-routing layer (DeepSeek-V4): pass token_ids")
    token_ids = jnp.asarray(token_ids)
    if token_ids.size != num_tokens or not jnp.issubdtype(token_ids.dtype, jnp.integer):
        raise ValueError(f"route: token_ids must be {num_tokens} integers (one per token), "
                         f"got shape {token_ids.shape} dtype {token_ids.dtype}")
    return token_ids.reshape(-1)


def check_tokens(x: jax.Array, cfg: MoEConfig) -> jax.Array:
    """Validate ``x`` [T, H] or [B, S, H] and return it as [T, H]."""
    if not hasattr(x, "shape") or x.ndim not in (2, 3):
        raise ValueError(f"x must be [T, H] or [B, S, H], got shape {getattr(x, 'shape', x)}")
    if x.shape[-1] != cfg.hidden_size:
        raise ValueError(f"x: last dim must be hidden_size={cfg.hidden_size}, got {x.shape[-1]}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be floating point, got {x.dtype}")
    return x.reshape(-1, cfg.hidden_size)
