"""Plain-jnp router: ``RouterRule`` applied to float32 logits, as the kernel states it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.routing.config import RouterRule, Scoring


def scores_reference(logits: jax.Array, scoring: Scoring) -> jax.Array:
    """``[T, E]`` f32 logits -> the scores the top-k selects on (``TOPK_SOFTMAX``: the logits)."""
    match scoring:
        case Scoring.SOFTMAX:
            return jax.nn.softmax(logits, axis=-1)
        case Scoring.SIGMOID:
            return jax.nn.sigmoid(logits)
        case Scoring.SQRT_SOFTPLUS:
            return jnp.sqrt(jax.nn.softplus(logits))
        case Scoring.TOPK_SOFTMAX:
            return logits


def route_reference(logits: jax.Array, rule: RouterRule, selection_bias: jax.Array | None = None,
                    expert_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``logits [T, E]`` -> (ids ``[T, k]`` int32, weights ``[T, k]`` f32); ties go to the lower
    index (``jax.lax.top_k``)."""
    t, e = logits.shape
    rule.check(e)
    logits = logits.astype(jnp.float32)
    s = scores_reference(logits, rule.scoring)
    choice = s if selection_bias is None else s + selection_bias.astype(jnp.float32)
    if rule.n_group > 1:
        grouped = choice.reshape(t, rule.n_group, e // rule.n_group)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, G]
        keep = jax.lax.top_k(group_score, rule.topk_group)[1]  # [T, topk_group]
        kept = jnp.any(keep[:, :, None] == jnp.arange(rule.n_group), axis=1)  # [T, G]
        choice = jnp.where(kept[:, :, None], grouped, 0.0).reshape(t, e)
    ids = jax.lax.top_k(choice, rule.k)[1].astype(jnp.int32)
    w = jnp.take_along_axis(s, ids, axis=-1)
    if rule.scoring is Scoring.TOPK_SOFTMAX:
        w = jax.nn.softmax(w, axis=-1)
    elif rule.normalize:
        w = w / (w.sum(-1, keepdims=True) + rule.norm_eps)
    w = w * rule.scale
    if expert_scale is not None:
        w = w * jnp.take(expert_scale.astype(jnp.float32), ids, mode="clip")
    return ids, w.astype(jnp.float32)
