"""Plain-``jnp`` reference of the MoE decode step's routed experts, float32 throughout.

For each (token, slot) pair ``(t, j)`` with a real expert ``e = expert_ids[t, j]`` (``0 <= e <
E``): ``h = act(x[t] @ dequant(gate_up[e])^T + gate_up_bias[e])`` rounded to ``h_dtype`` (the
kernels store h in that dtype between their two launches), ``y[t, j] = h @ dequant(down[e])^T +
down_bias[e]``; W8A8 (``*_act_quant`` fp8) replaces x / h by their e4m3 values per row per 128
of K times the scales (``quantize_activations_fp8``). Ids outside ``[0, E)`` are zero experts
(LongCat): their pair output is 0 and the combine adds ``weights[t, j] * x[t]`` instead.
``moe_decode_reference`` returns the combine ``sum_j weights[t, j] * y[t, j]`` in float32.

The reference dequantizes the selected experts' weights once per pair (fine for a reference,
never for the decode path) with the grouped matmul's ``dequantize_weights``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul.config import (
    Activation,
    ActivationQuant,
    GateUpLayout,
    WeightFormat,
)
from pallas_kernels.grouped_matmul.reference import (
    GPT_OSS_ALPHA,
    GPT_OSS_LIMIT,
    dequantize_activations_fp8,
    dequantize_weights,
    gated_activation,
    quantize_activations_fp8,
    rounded,
    split_gate_up,
)

_HIGHEST = jax.lax.Precision.HIGHEST


def _take(a, ids):
    return None if a is None else jnp.take(a, ids, axis=0)


def _expert_weights(w, scale, global_scale, ids, fmt, block_size):
    """Dequantized weights of the experts ``ids`` [P] -> [P, N, K] float32."""
    if global_scale is not None:
        global_scale = global_scale.reshape(global_scale.shape[0], -1)
    return dequantize_weights(_take(w, ids), fmt, scale=_take(scale, ids),
                              global_scale=_take(global_scale, ids), block_size=block_size)


def _act_quant(x: jax.Array, act_quant) -> jax.Array:
    """``x`` in float32 as a matmul sees it: as is, or its W8A8 e4m3 values times scales."""
    if ActivationQuant.coerce(act_quant) is ActivationQuant.FP8:
        return dequantize_activations_fp8(*quantize_activations_fp8(x))
    return x.astype(jnp.float32)


def activate(h: jax.Array, activation: Activation, layout: GateUpLayout, limit: float | None,
             alpha: float = GPT_OSS_ALPHA) -> jax.Array:
    """``act(gate) * up`` of ``h [..., 2I]`` in float32. SiLU with a ``limit`` clamps first
    (gate <= limit, |up| <= limit: DeepSeek-V4); gpt-oss clamps by its own rule."""
    gate, up = split_gate_up(h.astype(jnp.float32), layout)
    activation = Activation.coerce(activation)
    if activation is Activation.SILU and limit is not None:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    kw = {}
    if activation is Activation.GPT_OSS:
        kw = dict(alpha=alpha, limit=GPT_OSS_LIMIT if limit is None else limit)
    return gated_activation(gate, up, activation, **kw)


@functools.partial(
    jax.jit,
    static_argnames=("fmt", "activation", "gate_up_layout", "limit", "alpha", "block_size",
                     "h_dtype", "gate_up_act_quant", "down_act_quant"),
)
def moe_decode_pairs_reference(
    x: jax.Array,  # [T, H]
    expert_ids: jax.Array,  # [T, k] int; outside [0, E): zero expert
    gate_up: jax.Array,  # [E, 2I, H] | [E, 2I, H//2] u8
    down: jax.Array,  # [E, H, I] | [E, H, I//2] u8
    *,
    fmt: WeightFormat | str,
    gate_up_scale: jax.Array | None = None,
    gate_up_global_scale: jax.Array | None = None,  # NVFP4 [E, R] or [E]
    gate_up_bias: jax.Array | None = None,  # [E, 2I]
    down_scale: jax.Array | None = None,
    down_global_scale: jax.Array | None = None,
    down_bias: jax.Array | None = None,  # [E, H]
    activation: Activation | str = Activation.SILU,
    gate_up_layout: GateUpLayout | str = GateUpLayout.CONCATENATED,
    limit: float | None = None,
    alpha: float = GPT_OSS_ALPHA,
    block_size: tuple[int, int] = (128, 128),
    h_dtype=jnp.bfloat16,
    gate_up_act_quant: ActivationQuant | str = ActivationQuant.NONE,
    down_act_quant: ActivationQuant | str = ActivationQuant.NONE,
) -> jax.Array:  # [T, k, H] float32, zero-expert pairs 0
    fmt = WeightFormat.coerce(fmt)
    t, k = expert_ids.shape
    e = gate_up.shape[0]
    ids = expert_ids.reshape(-1).astype(jnp.int32)  # [P]
    routed = (ids >= 0) & (ids < e)
    safe = jnp.where(routed, ids, 0)
    xp = jnp.repeat(_act_quant(x, gate_up_act_quant), k, axis=0)  # [P, H] pair order

    wgu = _expert_weights(gate_up, gate_up_scale, gate_up_global_scale, safe, fmt, block_size)
    h = jnp.einsum("ph,pnh->pn", xp, wgu, precision=_HIGHEST)  # [P, 2I]
    if gate_up_bias is not None:
        h = h + gate_up_bias.astype(jnp.float32)[safe]
    a = activate(h, activation, GateUpLayout.coerce(gate_up_layout), limit, alpha)
    a = _act_quant(rounded(a, h_dtype), down_act_quant)  # [P, I], as the kernels store it
    wdn = _expert_weights(down, down_scale, down_global_scale, safe, fmt, block_size)
    y = jnp.einsum("pi,phi->ph", a, wdn, precision=_HIGHEST)  # [P, H]
    if down_bias is not None:
        y = y + down_bias.astype(jnp.float32)[safe]
    y = jnp.where(routed[:, None], y, 0.0)
    return y.reshape(t, k, -1)


def combine_reference(pairs: jax.Array, x: jax.Array, expert_ids: jax.Array,
                      weights: jax.Array, num_experts: int) -> jax.Array:
    """``sum_j weights[t, j] * (pairs[t, j] or x[t] for a zero expert)`` in float32. [T, H]"""
    routed = (expert_ids >= 0) & (expert_ids < num_experts)  # [T, k]
    vals = jnp.where(routed[..., None], pairs.astype(jnp.float32),
                     x.astype(jnp.float32)[:, None, :])
    return jnp.einsum("tk,tkh->th", weights.astype(jnp.float32), vals, precision=_HIGHEST)


def moe_decode_reference(x, expert_ids, weights, gate_up, down, **kwargs) -> jax.Array:
    """The routed experts' combined output ``[T, H]`` float32 (keywords as
    ``moe_decode_pairs_reference``)."""
    pairs = moe_decode_pairs_reference(x, expert_ids, gate_up, down, **kwargs)
    return combine_reference(pairs, x, expert_ids, weights, gate_up.shape[0])
