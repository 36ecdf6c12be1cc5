"""``moe_forward``: routing, experts (prefill or decode variant), shared expert, combine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from atlas_jax.config import KernelConfig, MoEPath
from atlas_jax.moe.experts import (
    routed_experts_decode,
    routed_experts_prefill,
    shared_experts,
    shared_folds,
)
from atlas_jax.moe.parallel import moe_forward_parallel
from atlas_jax.moe.params import MoEParams
from atlas_jax.moe.routing import check_tokens, rms_normalize, route


def choose_path(num_tokens: int, kernels: KernelConfig) -> MoEPath:
    """The variant for ``num_tokens`` (static): decode for few tokens unless forced."""
    if kernels.moe_path is not MoEPath.AUTO:
        return kernels.moe_path
    return MoEPath.DECODE if num_tokens <= kernels.decode_max_tokens else MoEPath.PREFILL


def moe_forward(
    params: MoEParams,
    x: jax.Array,  # [T, H] or [B, S, H]
    *,
    token_ids: jax.Array | None = None,  # [T] or [B, S] int, hash-routing layers only
    kernels: KernelConfig | None = None,
    mesh: Mesh | None = None,  # expert parallel over this mesh (params from aj.moe.shard)
    expert_axis: str | None = None,  # mesh only; None: the axis aj.moe.shard used, or "expert"
    data_axis: str | None = None,  # mesh only; tokens split over (data_axis, expert_axis)
) -> jax.Array:  # same shape and dtype as x
    """One MoE layer: ``y = sum_k w_k * expert_k(x) (+ shared(x))``, float32 accumulation.

    With ``mesh``: the expert-parallel forward of ``atlas_jax.moe.parallel`` (same result).
    """
    if mesh is not None:
        return moe_forward_parallel(params, x, mesh, expert_axis=expert_axis,
                                    data_axis=data_axis, token_ids=token_ids, kernels=kernels)
    if expert_axis is not None or data_axis is not None:
        raise ValueError("moe_forward: expert_axis / data_axis need mesh=")
    if not isinstance(params, MoEParams):
        raise TypeError(f"moe_forward: params must be MoEParams, got {type(params).__name__}")
    kernels = kernels or KernelConfig()
    cfg = params.config
    x2 = check_tokens(x, cfg)
    if x2.shape[0] == 0:
        return jnp.zeros_like(x)
    r = route(params, x2, token_ids, kernels=kernels)
    xe = x2
    if params.pre_expert_norm is not None:
        xe = (rms_normalize(x2, cfg.rms_norm_eps) * params.pre_expert_norm.astype(jnp.float32)
              ).astype(x.dtype)
    decode = choose_path(x2.shape[0], kernels) is MoEPath.DECODE
    fold = decode and shared_folds(params, x2.shape[0], kernels)
    if decode:
        y = routed_experts_decode(params, xe, r, kernels, fold_shared=fold)
    else:
        y = routed_experts_prefill(params, xe, r, kernels)
    if params.shared_gate_up is not None and not fold:
        y = y + shared_experts(params, xe, kernels, decode=decode)
    return y.astype(x.dtype).reshape(x.shape)
