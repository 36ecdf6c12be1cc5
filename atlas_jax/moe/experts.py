"""Expert MLPs: the prefill (sorted grouped matmul) and decode (gather the selected experts
only) variants, and the shared expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from atlas_jax import ops
from atlas_jax.config import GateUpLayout, KernelConfig, MoEConfig
from atlas_jax.moe.dispatch import combine, permute, unpermute
from atlas_jax.moe.params import MoEParams
from atlas_jax.moe.routing import Routing
from atlas_jax.ops.activation import GateUp, gated_activation
from atlas_jax.ops.grouped_matmul import compute_dtype
from atlas_jax.quant import QTensor, dequantize


def routed_experts_prefill(params: MoEParams, x: jax.Array, r: Routing,
                           kernels: KernelConfig) -> jax.Array:
    """Sort (token, slot) pairs by expert, grouped matmuls, un-sort, combine. [T, H] -> [T, H] f32
    """
    cfg = params.config
    p = permute(r.expert_ids, cfg.num_experts)
    xs = x[p.token_of_row]  # [T*k, H] rows sorted by expert
    a = ops.grouped_matmul(xs, params.gate_up, p.group_sizes, bias=params.gate_up_bias,
                           epilogue=GateUp.of(cfg), kernels=kernels)  # [T*k, I] f32
    a = a.astype(compute_dtype(x))
    y = ops.grouped_matmul(a, params.down, p.group_sizes, bias=params.down_bias,
                           kernels=kernels)  # [T*k, H] f32
    return combine(unpermute(y, p), x, r, cfg.num_experts)


def routed_experts_decode(params: MoEParams, x: jax.Array, r: Routing) -> jax.Array:
    """Few tokens: gather the weights of the distinct selected experts only (at most
    min(E, T*k) of them), run every token through each, pick each pair's row. [T, H] f32 out."""
    cfg = params.config
    t, k = r.expert_ids.shape
    e = cfg.num_experts
    u = min(e, t * k)
    ids = jnp.where(r.expert_ids < e, r.expert_ids, e)  # zero experts -> e (filtered below)
    uniq = jnp.unique(ids, size=u, fill_value=e)  # [U] sorted, padded with e
    slot = jnp.searchsorted(uniq, ids)  # [T, k] position of each pair's expert in uniq
    safe = jnp.minimum(uniq, e - 1)  # padding entries read expert e-1; never selected
    dtype = compute_dtype(x)
    xc = x.astype(dtype)
    gu = dequantize(params.gate_up.take(safe), dtype=dtype)  # [U, 2I, H]
    h = jnp.einsum("th,unh->utn", xc, gu, preferred_element_type=jnp.float32)  # [U, T, 2I]
    if params.gate_up_bias is not None:
        h = h + params.gate_up_bias[safe][:, None, :].astype(jnp.float32)
    a = gated_activation(h, GateUp.of(cfg)).astype(dtype)  # [U, T, I]
    dn = dequantize(params.down.take(safe), dtype=dtype)  # [U, H, I]
    y = jnp.einsum("uti,uhi->uth", a, dn, preferred_element_type=jnp.float32)  # [U, T, H]
    if params.down_bias is not None:
        y = y + params.down_bias[safe][:, None, :].astype(jnp.float32)
    pairs = y[jnp.minimum(slot, u - 1), jnp.arange(t)[:, None]]  # [T, k, H]
    return combine(pairs.reshape(t * k, -1), x, r, e)


def dense_mlp(x: jax.Array, gate_up: QTensor, down: QTensor, cfg: MoEConfig) -> jax.Array:
    """One (shared) expert, gate|up concatenated: [T, H] -> [T, H] f32."""
    dtype = compute_dtype(x)
    h = jnp.einsum("th,nh->tn", x.astype(dtype), dequantize(gate_up, dtype=dtype),
                   preferred_element_type=jnp.float32)
    a = gated_activation(h, GateUp.of(cfg, GateUpLayout.CONCATENATED)).astype(dtype)
    return jnp.einsum("ti,hi->th", a, dequantize(down, dtype=dtype),
                      preferred_element_type=jnp.float32)


def shared_experts(params: MoEParams, x: jax.Array) -> jax.Array:
    """Shared expert output, gated by sigmoid(x . w_gate) where the config has a gate."""
    y = dense_mlp(x, params.shared_gate_up, params.shared_down, params.config)
    if params.shared_gate is not None:
        g = jnp.einsum("th,oh->to", x.astype(jnp.float32), params.shared_gate.astype(jnp.float32))
        y = y * jax.nn.sigmoid(g)
    return y
