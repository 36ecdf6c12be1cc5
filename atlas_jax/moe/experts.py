"""Expert MLPs: the prefill (sorted grouped matmul) and decode (gather the selected experts
only) variants, and the shared expert.

``MoEConfig.gate_up_act_quant`` / ``down_act_quant`` (W8A8) apply to every FP8_BLOCK expert
matmul of the layer: the routed experts and a shared expert stored in FP8_BLOCK
(``act_quants``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from atlas_jax import ops
from atlas_jax.config import ActQuant, Backend, Format, GateUpLayout, KernelConfig, MoEConfig
from atlas_jax.moe.dispatch import combine, permute, unpermute
from atlas_jax.moe.params import MoEParams
from atlas_jax.moe.routing import Routing
from atlas_jax.ops.activation import GateUp, gated_activation
from atlas_jax.ops.grouped_matmul import FP4_ACTIVATIONS, compute_dtype, expert_einsum
from atlas_jax.ops.moe_decode import extra_unsupported_reason
from atlas_jax.quant import QTensor


def act_quants(cfg: MoEConfig, fmt: Format) -> dict[str, ActQuant]:
    """``{gate_up_act_quant, down_act_quant}`` for an expert matmul pair stored in ``fmt``: the
    config's where ``fmt`` is FP8_BLOCK (the validated case), none otherwise. NVFP4 activations
    (W4A4) raise NotImplementedError: they need FP4 tensor cores, which no path here uses."""
    for name in ("gate_up_act_quant", "down_act_quant"):
        if getattr(cfg, name) is ActQuant.NVFP4:
            raise NotImplementedError(f"MoEConfig.{name}=nvfp4: {FP4_ACTIVATIONS}")
    fp8 = fmt is Format.FP8_BLOCK
    return dict(gate_up_act_quant=cfg.gate_up_act_quant if fp8 else ActQuant.NONE,
                down_act_quant=cfg.down_act_quant if fp8 else ActQuant.NONE)


def routed_experts_prefill(params: MoEParams, x: jax.Array, r: Routing,
                           kernels: KernelConfig) -> jax.Array:
    """Sort (token, slot) pairs by expert, grouped matmuls, un-sort, combine. [T, H] -> [T, H] f32
    """
    cfg = params.config
    p = permute(r.expert_ids, cfg.num_experts)
    xs = x[p.token_of_row]  # [T*k, H] rows sorted by expert
    quant = act_quants(cfg, params.gate_up.format)
    a = ops.grouped_matmul(xs, params.gate_up, p.group_sizes, bias=params.gate_up_bias,
                           epilogue=GateUp.of(cfg), kernels=kernels,
                           act_quant=quant["gate_up_act_quant"])  # [T*k, I] f32
    a = a.astype(compute_dtype(x))
    y = ops.grouped_matmul(a, params.down, p.group_sizes, bias=params.down_bias,
                           kernels=kernels, act_quant=quant["down_act_quant"])  # [T*k, H] f32
    return combine(unpermute(y, p), x, r, cfg.num_experts)


def routed_experts_decode(params: MoEParams, x: jax.Array, r: Routing,
                          kernels: KernelConfig | None = None, *,
                          fold_shared: bool = False) -> jax.Array:
    """Few tokens: read only the distinct selected experts (at most min(E, T*k) of them), once
    (``ops.moe_decode``: XLA gather+einsum or the Pallas expert-major kernels, by
    ``kernels.grouped_matmul``), then combine. [T, H] f32 out.

    ``fold_shared`` (``shared_folds``): the shared expert is read by the same launches, as
    ``ops.moe_decode``'s extra stack that every token selects once more (id E), and its gated
    output is added here."""
    cfg = params.config
    e = cfg.num_experts
    t, k = r.expert_ids.shape
    ids, extra = r.expert_ids, None
    if fold_shared:
        routed = (ids >= 0) & (ids < e)
        ids = jnp.concatenate([jnp.where(routed, ids, e + 1),  # zero experts stay outside
                               jnp.full((t, 1), e, ids.dtype)], axis=1)
        extra = (params.shared_gate_up.stacked(), params.shared_down.stacked())
    pairs = ops.moe_decode(x, ids, params.gate_up, params.down,
                           gate_up_bias=params.gate_up_bias, down_bias=params.down_bias,
                           epilogue=GateUp.of(cfg), kernels=kernels, extra=extra,
                           **act_quants(cfg, params.gate_up.format))  # [T, k (+1), H] f32
    y = combine(pairs[:, :k].reshape(t * k, -1), x, r, e)
    if fold_shared:
        y = y + _shared_gated(params, x, pairs[:, k])
    return y


def dense_mlp(x: jax.Array, gate_up: QTensor, down: QTensor, cfg: MoEConfig) -> jax.Array:
    """One (shared) expert, gate|up concatenated: [T, H] -> [T, H] f32."""
    quant = act_quants(cfg, gate_up.format)
    dtype = compute_dtype(x)
    h = expert_einsum("th,nh->tn", x.astype(dtype), gate_up, quant["gate_up_act_quant"])
    a = gated_activation(h, GateUp.of(cfg, GateUpLayout.CONCATENATED)).astype(dtype)
    return expert_einsum("ti,hi->th", a, down, quant["down_act_quant"])


# Shared-expert formats and token counts for which the decode kernels beat XLA's dense path
# (H200, DeepSeek-V3 shared expert 7168 x 2048, benchmarks/moe_decode.py, 2026-12-01; us):
#   NVFP4 1-8 tokens: kernels 109-121 vs dense 146-157; MXFP4 1-3: 139-146 vs 151-152, 8:
#   150 vs 142; BF16: 47-53 vs 39-50 (no gain); FP8: 104-113 vs 90-103 (no gain); every
#   format at 32-64 tokens: the kernels re-read the weights per 16-row chunk (83-578 vs 43-157).
SHARED_KERNEL_FORMATS = (Format.NVFP4, Format.MXFP4)
SHARED_KERNEL_MAX_TOKENS = 8


# A decode step of up to this many tokens reads a shared expert with the routed experts' format
# and shapes in the routed launches (one 16-row chunk of the kernels: more rows would re-read
# its weights per chunk, as in the 32-64 token rows above). Measured on the H200 (DeepSeek-V3
# layer with its shared expert, full moe_forward step, folded vs on its own path, us;
# benchmarks/RESULTS.md, sessions 5 and 6): FP8 1 / 8 tokens 230 / 788 vs 293 / 843, NVFP4 296 /
# 991 vs 334 / 1039, MXFP4 1 / 8 / 16 tokens 281 / 1011 / 1470 vs 362 / 1085 / 1567, BF16
# 236 / 1005 / 1509 vs 242 / 1009 / 1508 (even): every format folds.
SHARED_FOLD_MAX_TOKENS = 16


def shared_folds(params: MoEParams, num_tokens: int, kernels: KernelConfig | None) -> bool:
    """Whether a decode step of ``num_tokens`` (at most ``SHARED_FOLD_MAX_TOKENS``) folds the
    shared expert into the routed launches (``routed_experts_decode(fold_shared=True)``): the
    Pallas decode kernels run the routed experts, and the shared expert has their format,
    per-expert shapes and scale layout (``ops.moe_decode``'s ``extra_unsupported_reason``)."""
    gu, dn = params.shared_gate_up, params.shared_down
    if gu is None or num_tokens > SHARED_FOLD_MAX_TOKENS:
        return False
    if ops.moe_decode_backend(params.gate_up, params.down, kernels) is not Backend.PALLAS:
        return False
    return extra_unsupported_reason(params.gate_up, params.down, (gu.stacked(), dn.stacked()),
                                    params.gate_up_bias, params.down_bias) is None


def shared_expert_uses_kernels(shared: QTensor, num_tokens: int) -> bool:
    """Whether a decode step runs the shared expert through the decode kernels (where that
    measured faster than XLA's dense path, which first writes a dequantized copy to HBM)."""
    return (shared.format in SHARED_KERNEL_FORMATS
            and num_tokens <= SHARED_KERNEL_MAX_TOKENS)


def shared_experts(params: MoEParams, x: jax.Array, kernels: KernelConfig | None = None, *,
                   decode: bool = False) -> jax.Array:
    """Shared expert output, gated by sigmoid(x . w_gate) where the config has a gate.

    ``decode`` with the Pallas decode kernels chosen (``ops.moe_decode``'s backend for the
    shared weights) and ``shared_expert_uses_kernels``: the shared expert runs through those
    kernels as a one-expert stack that every token selects, reading its quantized weights once.
    Otherwise XLA's dense path."""
    cfg = params.config
    gu, dn = params.shared_gate_up, params.shared_down
    if (decode and shared_expert_uses_kernels(gu, x.shape[0])
            and ops.moe_decode_backend(gu, dn, kernels) is Backend.PALLAS):
        ids = jnp.zeros((x.shape[0], 1), jnp.int32)
        y = ops.moe_decode(x, ids, gu.stacked(), dn.stacked(),
                           epilogue=GateUp.of(cfg, GateUpLayout.CONCATENATED),
                           kernels=kernels, **act_quants(cfg, gu.format))[:, 0]
    else:
        y = dense_mlp(x, gu, dn, cfg)
    return _shared_gated(params, x, y)


def _shared_gated(params: MoEParams, x: jax.Array, y: jax.Array) -> jax.Array:
    """The shared expert's output ``y`` times sigmoid(x . w_gate) where the config has a gate."""
    if params.shared_gate is None:
        return y
    g = jnp.einsum("th,oh->to", x.astype(jnp.float32), params.shared_gate.astype(jnp.float32))
    return y * jax.nn.sigmoid(g)
