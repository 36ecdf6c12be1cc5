"""Grouped matmul, the kernel boundary of the expert MLPs.

``out[m] = x[m] @ W[g(m)]^T (+ bias[g(m)])`` over rows sorted by group, with ``group_sizes[g]``
rows per group; rows past ``sum(group_sizes)`` are padding and come out as zeros. ``W`` is a
QTensor ``[G, N, K]`` of any format. With an ``epilogue`` (a gate_up matmul) the result is
``act(gate) * up`` of width ``N / 2``. The "xla" implementation is the plain-jnp reference
(dequantize, then ``jax.lax.ragged_dot`` accumulating in float32); the "pallas" one
(``pallas_kernels.grouped_matmul``) dequantizes inside the kernel and fuses the epilogue.
``KernelConfig.gmm_kernel`` picks the Pallas kernel: the Triton-lowering one (every format, every
NVIDIA generation) or the Mosaic GPU one (BF16 on Hopper: TMA + wgmma, warp-specialized);
"auto" takes Mosaic GPU on sm_90 for what it supports and Triton otherwise (and in interpret mode).

``act_quant=ActQuant.FP8`` (W8A8, FP8_BLOCK weights): the activations are quantized per row per
128 of K to e4m3 with an f32 scale (``amax / 448``, as transformers' FP8 linear layers do on a
GPU) before the matmul; the reference multiplies the dequantized values in float32, the Triton
kernel takes the e4m3 rows and both scales per K step. ``ActQuant.NVFP4`` (FP4 activations)
needs FP4 tensor cores and is not implemented (NotImplementedError).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from atlas_jax.config import Activation, ActQuant, Backend, Format, GmmKernel, KernelConfig
from atlas_jax.ops._dispatch import interpret_mode, resolve_backend
from atlas_jax.ops.activation import GateUp, gated_activation
from atlas_jax.quant import QTensor, dequantize


def compute_dtype(x: jax.Array) -> jnp.dtype:
    """Operand dtype of the reference matmuls: f32 stays f32, anything else runs in bf16."""
    return jnp.dtype(jnp.float32) if x.dtype == jnp.float32 else jnp.dtype(jnp.bfloat16)


FP4_ACTIVATIONS = ("FP4 activations (W4A4) need FP4 tensor cores (sm_100+); atlas_jax "
                   "implements W8A8 (fp8) and the weight-only formats")


def quantized_activations(x: jax.Array, act_quant: ActQuant) -> jax.Array:
    """The activations ``[..., K]`` a reference matmul multiplies: ``x`` unchanged
    (``ActQuant.NONE``), or its W8A8 values (e4m3 per row per 128 of K, times the scales) in
    float32."""
    if act_quant is ActQuant.NONE:
        return x
    if act_quant is ActQuant.FP8:
        from pallas_kernels.grouped_matmul.reference import (
            dequantize_activations_fp8,
            quantize_activations_fp8,
        )

        # the barrier keeps x's own rounding (a bf16 h) under XLA's GPU excess-precision rule
        # (pallas_kernels.grouped_matmul.reference.rounded); the kernels quantize stored x
        rows = jax.lax.optimization_barrier(x).reshape(-1, x.shape[-1])
        return dequantize_activations_fp8(*quantize_activations_fp8(rows)).reshape(x.shape)
    raise NotImplementedError(f"act_quant={act_quant.value}: {FP4_ACTIVATIONS}")


def _precision(dtype):
    """The reference dots' precision: exact float32 products for float32 operands."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def expert_einsum(spec: str, act: jax.Array, w: QTensor,
                  act_quant: ActQuant = ActQuant.NONE) -> jax.Array:
    """One reference expert matmul ``einsum(spec, act, dequant(w))``, float32 out: operands in
    ``compute_dtype``, W8A8 (``act_quant``) on the dequantized activations in float32."""
    act = quantized_activations(act, act_quant)
    dtype = compute_dtype(act)
    return jnp.einsum(spec, act.astype(dtype), dequantize(w, dtype=dtype),
                      preferred_element_type=jnp.float32, precision=_precision(dtype))


def check_act_quant(op: str, w: QTensor, act_quant) -> ActQuant:
    """``act_quant`` as an ActQuant; raises where the weights' format cannot take it."""
    act_quant = ActQuant(act_quant)
    if act_quant is ActQuant.FP8 and w.format is not Format.FP8_BLOCK:
        raise ValueError(f"{op}: act_quant=fp8 (W8A8) needs FP8_BLOCK weights, got "
                         f"{w.format.value}")
    if act_quant is ActQuant.NVFP4:
        raise NotImplementedError(f"{op}: act_quant=nvfp4: {FP4_ACTIVATIONS}")
    return act_quant


def group_ids(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """Group of each sorted row; padding rows get ``len(group_sizes)``."""  # [M]
    ends = jnp.cumsum(group_sizes)  # [G]
    return jnp.searchsorted(ends, jnp.arange(num_rows), side="right").astype(jnp.int32)


def grouped_matmul_reference(
    x: jax.Array,  # [M, K]
    w: QTensor,  # [G, N, K]
    group_sizes: jax.Array,  # [G] int32
    bias: jax.Array | None = None,  # [G, N]
    epilogue: GateUp | None = None,
    act_quant: ActQuant = ActQuant.NONE,
) -> jax.Array:  # [M, N] (or [M, N/2] with an epilogue) float32
    x = quantized_activations(x, act_quant)  # W8A8: float32 (the exact products)
    dtype = compute_dtype(x)
    wt = jnp.swapaxes(dequantize(w, dtype=dtype), -1, -2)  # [G, K, N]
    out = jax.lax.ragged_dot(
        x.astype(dtype), wt, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32,
        precision=_precision(dtype))
    gid = group_ids(group_sizes, x.shape[0])  # [M]
    if bias is not None:
        out = out + jnp.take(bias.astype(jnp.float32), gid, axis=0, mode="fill", fill_value=0)
    if epilogue is not None:
        out = gated_activation(out, epilogue)
    return jnp.where((gid < w.shape[0])[:, None], out, 0.0)


def _kernel_fuses(epilogue: GateUp | None) -> bool:
    """Whether the Pallas epilogue implements ``epilogue`` (its SiLU has no clamp)."""
    return epilogue is not None and not (
        epilogue.activation is Activation.SILU and epilogue.limit is not None)


def grouped_matmul_pallas(
    x: jax.Array,  # [M, K]
    w: QTensor,  # [G, N, K]
    group_sizes: jax.Array,  # [G] int32
    bias: jax.Array | None = None,  # [G, N]
    epilogue: GateUp | None = None,
    kernels: KernelConfig | None = None,
    act_quant: ActQuant = ActQuant.NONE,
) -> jax.Array:
    fused = _kernel_fuses(epilogue)
    if act_quant is ActQuant.NONE and _use_mosaic(x, w, bias, epilogue if fused else None,
                                                   kernels):
        out = _mosaic(x, w, group_sizes, bias, epilogue if fused else None)
    else:
        out = _triton(x, w, group_sizes, bias, epilogue if fused else None, kernels, act_quant)
    return out if fused or epilogue is None else gated_activation(out, epilogue)


def _use_mosaic(x, w: QTensor, bias, epilogue: GateUp | None,
                kernels: KernelConfig | None) -> bool:
    """KernelConfig.gmm_kernel, with "auto" resolved: Mosaic GPU on an sm_90 GPU when it supports
    the problem (BF16 weights and activations, concatenated gate_up, no bias, its shape limits)
    and no ``gmm_*`` tile override asks for the Triton kernel's tiles."""
    k = kernels or KernelConfig()
    match k.gmm_kernel:
        case GmmKernel.TRITON:
            return False
        case GmmKernel.MOSAIC:
            return True
        case GmmKernel.AUTO:
            from pallas_kernels.grouped_matmul import device_compute_capability

            overrides = (k.gmm_block_m, k.gmm_block_n, k.gmm_block_k, k.gmm_gate_up_block_m,
                         k.gmm_num_stages)
            if any(v is not None for v in overrides):
                return False
            if interpret_mode() or device_compute_capability() != (9, 0):
                return False
            return _mosaic_unsupported(x, w, bias, epilogue) is None


def _mosaic_unsupported(x, w: QTensor, bias, epilogue: GateUp | None) -> str | None:
    from pallas_kernels.grouped_matmul import mosaic_unsupported_reason

    if w.format is not Format.BF16:
        return f"w: the Mosaic GPU grouped matmul takes BF16 weights, got {w.format.value}"
    n = w.shape[1] // (2 if epilogue is not None else 1)
    return mosaic_unsupported_reason(
        x.dtype, w.data.dtype, n, w.shape[2], fused_gate_up=epilogue is not None,
        gate_up_layout=epilogue.layout.value if epilogue is not None else "concatenated",
        out_dtype=jnp.float32, bias=bias is not None)


def _mosaic(x, w: QTensor, group_sizes, bias, epilogue: GateUp | None) -> jax.Array:
    from pallas_kernels.grouped_matmul import grouped_matmul_mosaic

    reason = _mosaic_unsupported(x, w, bias, epilogue)
    if reason:
        raise NotImplementedError(f"grouped_matmul (gmm_kernel='mosaic'): {reason}")
    kw = {}
    if epilogue is not None:
        kw = dict(activation=epilogue.activation.value, gate_up_layout=epilogue.layout.value)
        if epilogue.limit is not None:
            kw["limit"] = epilogue.limit
    return grouped_matmul_mosaic(x, w.data, group_sizes.astype(jnp.int32),
                                 out_dtype=jnp.float32, interpret=interpret_mode(), **kw)


def _triton(x, w: QTensor, group_sizes, bias, epilogue: GateUp | None,
            kernels: KernelConfig | None, act_quant: ActQuant = ActQuant.NONE) -> jax.Array:
    from pallas_kernels.grouped_matmul import grouped_matmul as kernel

    kw = dict(fmt=w.format.value, scale=w.scale, global_scale=w.global_scale, bias=bias,
              out_dtype=jnp.float32, tile=_tile(x, w, epilogue, kernels, act_quant),
              interpret=interpret_mode(), act_quant=act_quant.value)
    if w.format is Format.FP8_BLOCK:
        kw["block_size"] = w.block
    if epilogue is not None:
        kw.update(activation=epilogue.activation.value, gate_up_layout=epilogue.layout.value)
        if epilogue.limit is not None:
            kw["limit"] = epilogue.limit
    return kernel(x, w.data, group_sizes.astype(jnp.int32), **kw)


def _tile(x, w: QTensor, epilogue: GateUp | None, kernels: KernelConfig | None,
          act_quant: ActQuant = ActQuant.NONE):
    """The heuristic's tile with KernelConfig's overrides applied; None (the kernel's own
    heuristic) when nothing is overridden."""
    k = kernels or KernelConfig()
    block_m = k.gmm_gate_up_block_m if epilogue is not None else None
    overrides = dict(block_m=block_m or k.gmm_block_m, block_n=k.gmm_block_n,
                     block_k=k.gmm_block_k, num_stages=k.gmm_num_stages)
    overrides = {name: v for name, v in overrides.items() if v is not None}
    if not overrides:
        return None
    from pallas_kernels.grouped_matmul import choose_tile_config, device_kind, device_sm_count

    g, n, kdim = w.shape
    base = choose_tile_config(
        x.shape[0], n // 2 if epilogue is not None else n, kdim, g, w.format.value,
        fused_gate_up=epilogue is not None, fp8_block=w.block, sm_count=device_sm_count(),
        device_kind=device_kind(), act_quant=act_quant.value)
    return dataclasses.replace(base, **overrides)


def _check(x: jax.Array, w: QTensor, group_sizes: jax.Array, bias: jax.Array | None,
           epilogue: GateUp | None) -> None:
    if not isinstance(w, QTensor):
        raise TypeError(f"grouped_matmul: w must be a QTensor, got {type(w).__name__}")
    if x.ndim != 2:
        raise ValueError(f"grouped_matmul: x must be [M, K], got shape {x.shape}")
    if len(w.shape) != 3:
        raise ValueError(f"grouped_matmul: w must be [G, N, K], got logical shape {w.shape}")
    g, n, k = w.shape
    if x.shape[1] != k:
        raise ValueError(f"grouped_matmul: x has K={x.shape[1]}, w expects K={k}")
    if group_sizes.shape != (g,):
        raise ValueError(f"grouped_matmul: group_sizes must be [{g}], got {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"grouped_matmul: group_sizes must be integer, got {group_sizes.dtype}")
    if bias is not None and bias.shape != (g, n):
        raise ValueError(f"grouped_matmul: bias must be [{g}, {n}], got {bias.shape}")
    if epilogue is not None and n % 2:
        raise ValueError(f"grouped_matmul: a gate_up epilogue needs an even N, got N={n}")


def grouped_matmul(
    x: jax.Array,  # [M, K]
    w: QTensor,  # [G, N, K]
    group_sizes: jax.Array,  # [G] int32, sum <= M
    *,
    bias: jax.Array | None = None,  # [G, N]
    epilogue: GateUp | None = None,  # gate_up: return act(gate) * up, [M, N/2]
    kernels: KernelConfig | None = None,
    act_quant: ActQuant | str = ActQuant.NONE,  # fp8: W8A8 (FP8_BLOCK weights)
) -> jax.Array:  # [M, N] or [M, N/2] float32
    """Grouped matmul over rows sorted by group, float32 out (padding rows are zero)."""
    _check(x, w, group_sizes, bias, epilogue)
    act_quant = check_act_quant("grouped_matmul", w, act_quant)
    match resolve_backend("grouped_matmul", (kernels or KernelConfig()).grouped_matmul):
        case Backend.XLA:
            return grouped_matmul_reference(x, w, group_sizes, bias, epilogue, act_quant)
        case Backend.PALLAS:
            return grouped_matmul_pallas(x, w, group_sizes, bias, epilogue, kernels, act_quant)
