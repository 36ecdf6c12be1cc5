"""MoE decode experts, the kernel boundary of ``moe_forward``'s decode variant.

For a few tokens (decode, MTP verify) each (token, slot) pair ``(t, j)`` with a real expert
``e = expert_ids[t, j] < E`` gets ``y[t, j] = down[e] @ act(gate_up[e] @ x[t] + b1[e]) + b2[e]``;
zero-expert pairs (ids >= E, LongCat) come out as 0 (the combine adds their ``w * x``). Both
implementations read only the distinct selected experts' weights, at most ``min(E, T*k)`` of
them, with no host sync:

- "xla": gather those experts' weights (``QTensor.take``), dequantize them, run every token
  through each (two einsums), and pick each pair's row.
- "pallas" (``pallas_kernels.moe_decode``): expert-major kernels reading each selected expert's
  quantized weights once, dequantizing in registers, with the gate_up epilogue fused.
  ``KernelConfig.decode_kernel`` picks the family: the Triton-lowering kernels (every format),
  or the Mosaic GPU ones (``pallas_kernels.moe_decode.mosaic``: Hopper, BF16 / FP8 / NVFP4 /
  MXFP4 weights, the weight tile as the wgmma's register operand); "auto" takes Mosaic GPU on
  sm_90 for FP8 W8A16, where it measured 1.1-1.5x faster at 8-64 tokens, and for NVFP4 / MXFP4
  (1.0-1.5x at 1-64 tokens; H200, benchmarks/RESULTS.md).

``extra``: a second expert stack (``(gate_up, down)``, ``[E2, ...]``) whose experts the ids
``E .. E + E2 - 1`` name: a model's shared expert folded into the routed step
(``moe.experts.shared_folds``), read by the same two launches. It needs the main stack's
format, per-expert shapes and scale layout and no biases (``extra_unsupported_reason``).
Otherwise the shared expert runs on its own (``moe.experts.shared_experts``).

``gate_up_act_quant`` / ``down_act_quant`` = ``ActQuant.FP8`` (FP8_BLOCK weights): W8A8, that
matmul's activations (x, h) quantized per row per 128 of K as in ``ops.grouped_matmul``; the
XLA path multiplies their dequantized values in float32, the kernels take e4m3 x e4m3 dots.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from atlas_jax.config import ActQuant, Backend, Format, GmmKernel, KernelConfig
from atlas_jax.ops._dispatch import interpret_mode, resolve_backend
from atlas_jax.ops.activation import GateUp, gated_activation
from atlas_jax.ops.grouped_matmul import check_act_quant, compute_dtype, expert_einsum
from atlas_jax.quant import QTensor


def moe_decode_reference(
    x: jax.Array,  # [T, H]
    expert_ids: jax.Array,  # [T, k] int32; >= E: zero expert
    gate_up: QTensor,  # [E, 2I, H]
    down: QTensor,  # [E, H, I]
    gate_up_bias: jax.Array | None = None,  # [E, 2I]
    down_bias: jax.Array | None = None,  # [E, H]
    epilogue: GateUp | None = None,
    gate_up_act_quant: ActQuant = ActQuant.NONE,
    down_act_quant: ActQuant = ActQuant.NONE,
) -> jax.Array:  # [T, k, H] float32
    """Gather the distinct selected experts (at most min(E, T*k)), run every token through each,
    pick each pair's row."""
    epilogue = epilogue or GateUp()
    t, k = expert_ids.shape
    e = gate_up.shape[0]
    u = min(e, t * k)
    ids = jnp.where(expert_ids < e, expert_ids, e)  # zero experts -> e (filtered below)
    uniq = jnp.unique(ids, size=u, fill_value=e)  # [U] sorted, padded with e
    slot = jnp.searchsorted(uniq, ids)  # [T, k] position of each pair's expert in uniq
    safe = jnp.minimum(uniq, e - 1)  # padding entries read expert e-1; never selected
    dtype = compute_dtype(x)

    h = expert_einsum("th,unh->utn", x.astype(dtype), gate_up.take(safe),
                      gate_up_act_quant)  # [U, T, 2I]
    if gate_up_bias is not None:
        h = h + gate_up_bias[safe][:, None, :].astype(jnp.float32)
    a = gated_activation(h, epilogue).astype(dtype)  # [U, T, I]
    y = expert_einsum("uti,uhi->uth", a, down.take(safe), down_act_quant)  # [U, T, H]
    if down_bias is not None:
        y = y + down_bias[safe][:, None, :].astype(jnp.float32)
    pairs = y[jnp.minimum(slot, u - 1), jnp.arange(t)[:, None]]  # [T, k, H]
    return jnp.where((expert_ids < e)[..., None], pairs, 0.0)


def unsupported_reason(gate_up: QTensor, down: QTensor) -> str | None:
    """Why the Pallas decode kernels cannot run these weights, or None when they can."""
    if gate_up.format is not down.format:
        return (f"gate_up is {gate_up.format.value} but down is {down.format.value} (the kernels "
                "take one format)")
    if gate_up.format is Format.FP8_BLOCK:
        if gate_up.block != down.block:
            return f"FP8 blocks differ: gate_up {gate_up.block}, down {down.block}"
        if math.gcd(gate_up.block[1], 128) < 16:
            return (f"FP8 block along K {gate_up.block[1]} has no power-of-two divisor >= 16 "
                    "(the kernels' K step)")
    return None


def extra_unsupported_reason(gate_up: QTensor, down: QTensor, extra: tuple[QTensor, QTensor],
                             gate_up_bias=None, down_bias=None) -> str | None:
    """Why ``extra`` cannot be read by the same launches as ``gate_up`` / ``down``, or None."""
    if gate_up_bias is not None or down_bias is not None:
        return "the main stack has biases (the extra stack has none)"
    for name, w, x in (("gate_up", gate_up, extra[0]), ("down", down, extra[1])):
        if x.format is not w.format:
            return f"extra {name} is {x.format.value}, the main stack {w.format.value}"
        if len(x.shape) != 3 or x.shape[1:] != w.shape[1:]:
            return f"extra {name} is {x.shape}, the main stack's experts are {w.shape[1:]}"
        if x.block != w.block or x.data.dtype != w.data.dtype:
            return f"extra {name}'s block or dtype differs from the main stack's"
        if (w.global_scale is not None
                and x.global_scale.shape[-1] != w.global_scale.shape[-1]):
            return f"extra {name}'s global scale has another number of row segments"
    return None


def mosaic_unsupported_reason(x: jax.Array, gate_up: QTensor, down: QTensor,
                              gate_up_act_quant: ActQuant = ActQuant.NONE,
                              down_act_quant: ActQuant = ActQuant.NONE) -> str | None:
    """Why the Mosaic GPU decode kernels cannot run this call, or None when they can."""
    from pallas_kernels.moe_decode.mosaic import choose_slot_tile, format_name
    from pallas_kernels.moe_decode.mosaic import unsupported_reason as slot_reason

    reason = unsupported_reason(gate_up, down)
    if reason is not None:
        return reason
    if gate_up_act_quant is not ActQuant.NONE or down_act_quant is not ActQuant.NONE:
        return "W8A8 activations run on the Triton decode kernels only"
    if compute_dtype(x) != jnp.bfloat16:
        return f"x: the Mosaic GPU decode kernels take bf16 activations, got {x.dtype}"
    fmt = format_name(gate_up.format.value, gate_up.data.dtype)
    for name, w in (("gate_up", gate_up), ("down", down)):
        n, k = w.shape[1:]
        rows = None
        if w.global_scale is not None:  # NVFP4 row segments
            rows = n // w.global_scale.reshape(w.shape[0], -1).shape[1]
        reason = slot_reason(fmt, w.data.dtype, n, k,
                             fp8_block=tuple(w.block) if fmt == "fp8" else None,
                             global_rows=rows, tile=choose_slot_tile(k, fmt=fmt),
                             experts=w.shape[0])
        if reason is not None:
            return f"{name}: {reason}"
    return None


def _use_mosaic(x, gate_up: QTensor, down: QTensor, kernels: KernelConfig | None,
                quant: dict) -> bool:
    """KernelConfig.decode_kernel, with "auto" resolved: Mosaic GPU on an sm_90 GPU, where it
    supports the shapes, for FP8_BLOCK weights without W8A8 and for NVFP4 / MXFP4 (BF16 stays
    on Triton: even at 8-64 tokens, slower at 1-2 on the H200)."""
    match (kernels or KernelConfig()).decode_kernel:
        case GmmKernel.TRITON:
            return False
        case GmmKernel.MOSAIC:
            return True
        case GmmKernel.AUTO:
            from pallas_kernels.grouped_matmul import device_compute_capability

            if interpret_mode() or device_compute_capability() != (9, 0):
                return False
            if gate_up.format not in (Format.FP8_BLOCK, Format.NVFP4, Format.MXFP4):
                return False
            return mosaic_unsupported_reason(x, gate_up, down, **quant) is None


def _weight_kwargs(gate_up: QTensor, down: QTensor, extra, epilogue: GateUp) -> dict:
    """The keywords both kernel families take: format, epilogue, scales, the extra stack."""
    from pallas_kernels.moe_decode import ExtraExperts

    kw = dict(fmt=gate_up.format.value, activation=epilogue.activation.value,
              gate_up_layout=epilogue.layout.value, limit=epilogue.limit,
              interpret=interpret_mode(), gate_up_scale=gate_up.scale,
              gate_up_global_scale=gate_up.global_scale, down_scale=down.scale,
              down_global_scale=down.global_scale)
    if gate_up.format is Format.FP8_BLOCK:
        kw["block_size"] = tuple(gate_up.block)
    if extra is not None:
        xg, xd = extra
        kw["extra"] = ExtraExperts(
            gate_up=xg.data, down=xd.data, gate_up_scale=xg.scale,
            gate_up_global_scale=xg.global_scale, down_scale=xd.scale,
            down_global_scale=xd.global_scale)
    return kw


def moe_decode_pallas(
    x: jax.Array,
    expert_ids: jax.Array,
    gate_up: QTensor,
    down: QTensor,
    gate_up_bias: jax.Array | None = None,
    down_bias: jax.Array | None = None,
    epilogue: GateUp | None = None,
    gate_up_act_quant: ActQuant = ActQuant.NONE,
    down_act_quant: ActQuant = ActQuant.NONE,
    extra: tuple[QTensor, QTensor] | None = None,
    kernels: KernelConfig | None = None,
) -> jax.Array:  # [T, k, H] float32
    """The Pallas decode kernels of ``kernels.decode_kernel``'s family (``_use_mosaic``)."""
    from pallas_kernels.moe_decode import moe_decode_pairs
    from pallas_kernels.moe_decode.mosaic import moe_decode_mosaic_pairs

    reason = unsupported_reason(gate_up, down)
    if reason is not None:
        raise NotImplementedError(f"moe_decode (pallas): {reason}")
    kw = _weight_kwargs(gate_up, down, extra, epilogue or GateUp())
    quant = dict(gate_up_act_quant=gate_up_act_quant, down_act_quant=down_act_quant)
    ids = expert_ids.astype(jnp.int32)
    bias = dict(gate_up_bias=gate_up_bias, down_bias=down_bias)
    if _use_mosaic(x, gate_up, down, kernels, quant):
        reason = mosaic_unsupported_reason(x, gate_up, down, **quant)
        if reason is not None:
            raise NotImplementedError(f"moe_decode (decode_kernel='mosaic'): {reason}")
        return moe_decode_mosaic_pairs(x.astype(jnp.bfloat16), ids, gate_up.data, down.data,
                                       **bias, **kw)
    return moe_decode_pairs(x.astype(compute_dtype(x)), ids, gate_up.data, down.data, **bias,
                            gate_up_act_quant=gate_up_act_quant.value,
                            down_act_quant=down_act_quant.value, **kw)


def _check(x, expert_ids, gate_up, down, gate_up_bias, down_bias) -> None:
    for name, w in (("gate_up", gate_up), ("down", down)):
        if not isinstance(w, QTensor):
            raise TypeError(f"moe_decode: {name} must be a QTensor, got {type(w).__name__}")
        if len(w.shape) != 3:
            raise ValueError(f"moe_decode: {name} must be [E, N, K], got shape {w.shape}")
    if x.ndim != 2:
        raise ValueError(f"moe_decode: x must be [T, H], got shape {x.shape}")
    e, two_i, h = gate_up.shape
    if x.shape[1] != h or down.shape != (e, h, two_i // 2):
        raise ValueError(f"moe_decode: x [T, {x.shape[1]}], gate_up {gate_up.shape} and down "
                         f"{down.shape} must be [T, H], [E, 2I, H], [E, H, I]")
    if expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe_decode: expert_ids must be [{x.shape[0]}, k], got "
                         f"{expert_ids.shape}")
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise TypeError(f"moe_decode: expert_ids must be integer, got {expert_ids.dtype}")
    if gate_up_bias is not None and gate_up_bias.shape != (e, two_i):
        raise ValueError(f"moe_decode: gate_up_bias must be [{e}, {two_i}], got "
                         f"{gate_up_bias.shape}")
    if down_bias is not None and down_bias.shape != (e, h):
        raise ValueError(f"moe_decode: down_bias must be [{e}, {h}], got {down_bias.shape}")


def decode_backend(gate_up: QTensor, down: QTensor, kernels: KernelConfig | None) -> Backend:
    """The implementation ``moe_decode`` runs for these weights under ``kernels``."""
    backend = (kernels or KernelConfig()).grouped_matmul
    return resolve_backend("moe_decode", backend, unsupported=unsupported_reason(gate_up, down))


def moe_decode(
    x: jax.Array,  # [T, H]
    expert_ids: jax.Array,  # [T, k] int; >= E: zero expert
    gate_up: QTensor,  # [E, 2I, H]
    down: QTensor,  # [E, H, I]
    *,
    gate_up_bias: jax.Array | None = None,  # [E, 2I]
    down_bias: jax.Array | None = None,  # [E, H]
    epilogue: GateUp | None = None,  # activation and gate/up layout (default SwiGLU, concat)
    kernels: KernelConfig | None = None,  # .grouped_matmul picks the implementation
    extra: tuple[QTensor, QTensor] | None = None,  # [E2, 2I, H], [E2, H, I]: ids E..E+E2-1
    gate_up_act_quant: ActQuant | str = ActQuant.NONE,  # fp8: W8A8 gate_up (FP8_BLOCK)
    down_act_quant: ActQuant | str = ActQuant.NONE,  # fp8: W8A8 down (FP8_BLOCK)
) -> jax.Array:  # [T, k, H] float32, zero-expert pairs 0
    """Each (token, slot) pair's routed-expert output, reading only the selected experts.

    ``kernels.grouped_matmul`` chooses: "xla", "pallas" (interpret mode off GPU), or "auto"
    (Pallas on GPU; the XLA path elsewhere, or when ``unsupported_reason`` names a reason, said
    once in a log line).
    """
    _check(x, expert_ids, gate_up, down, gate_up_bias, down_bias)
    quant = dict(gate_up_act_quant=check_act_quant("moe_decode", gate_up, gate_up_act_quant),
                 down_act_quant=check_act_quant("moe_decode", down, down_act_quant))
    if extra is not None:
        reason = extra_unsupported_reason(gate_up, down, extra, gate_up_bias, down_bias)
        if reason is not None:
            raise ValueError(f"moe_decode: extra: {reason}")
    args = (x, expert_ids, gate_up, down, gate_up_bias, down_bias, epilogue)
    match decode_backend(gate_up, down, kernels):
        case Backend.XLA:
            pairs = moe_decode_reference(*args, **quant)
            if extra is None:
                return pairs
            e, e2 = gate_up.shape[0], extra[0].shape[0]
            ids = jnp.where(expert_ids >= e, expert_ids - e, e2)  # main-stack ids: zero
            return pairs + moe_decode_reference(x, ids, *extra, epilogue=epilogue, **quant)
        case Backend.PALLAS:
            return moe_decode_pallas(*args, extra=extra, kernels=kernels, **quant)
