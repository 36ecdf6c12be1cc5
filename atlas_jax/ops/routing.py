"""Router selection, the kernel boundary of ``moe.route``: router logits -> (top-k expert ids,
weights) under the layer's ``MoEConfig`` rule.

- "xla": ``atlas_jax.moe.routing.route_logits`` (plain jnp: the spec, HF-golden tested).
- "pallas": ``pallas_kernels.routing`` -- one launch for the selection and the weights, where
  XLA takes two to three fusions (the top-k, the softmax or the gathered weights).

"auto" takes Pallas on a GPU for every rule but hash routing (its ids come from a table: no
selection to fuse).
"""

from __future__ import annotations

import jax

from atlas_jax.config import Backend, KernelConfig, MoEConfig
from atlas_jax.ops._dispatch import interpret_mode, resolve_backend


def unsupported_reason(cfg: MoEConfig) -> str | None:
    """Why the router kernel cannot route this layer, or None when it can."""
    if cfg.hash_routing:
        return "hash routing takes its expert ids from a table (nothing to select)"
    return None


def router_rule(cfg: MoEConfig):
    """The kernel's ``RouterRule`` of a layer."""
    from pallas_kernels.routing import RouterRule

    return RouterRule(scoring=cfg.scoring.value, k=cfg.top_k, normalize=cfg.norm_topk_prob,
                      norm_eps=cfg.norm_eps, scale=cfg.routed_scaling_factor,
                      n_group=cfg.n_group, topk_group=cfg.topk_group)


def router_backend(cfg: MoEConfig, kernels: KernelConfig | None) -> Backend:
    """The implementation ``moe.route`` runs for this layer under ``kernels.router``."""
    return resolve_backend("router", (kernels or KernelConfig()).router,
                           unsupported=unsupported_reason(cfg))


def route_pallas(logits: jax.Array, cfg: MoEConfig, selection_bias: jax.Array | None = None,
                 per_expert_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``logits [T, E+Z]`` f32 -> (ids ``[T, k]`` int32, weights ``[T, k]`` f32) by the Pallas
    router (interpret mode off GPU)."""
    from pallas_kernels.routing import route

    reason = unsupported_reason(cfg)
    if reason is not None:
        raise NotImplementedError(f"router (pallas): {reason}")
    return route(logits, router_rule(cfg), selection_bias, per_expert_scale,
                 interpret=interpret_mode())
