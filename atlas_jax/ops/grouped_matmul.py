"""Grouped matmul, the kernel boundary of the expert MLPs.

``out[m] = x[m] @ W[g(m)]^T (+ bias[g(m)])`` over rows sorted by group, with ``group_sizes[g]``
rows per group; rows past ``sum(group_sizes)`` are padding and come out as zeros. ``W`` is a
QTensor ``[G, N, K]`` of any format. The "xla" implementation is the plain-jnp reference
(dequantize, then ``jax.lax.ragged_dot`` accumulating in float32); the "pallas" implementation
dequantizes inside the kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from atlas_jax.config import Backend, KernelConfig
from atlas_jax.ops._dispatch import resolve_backend
from atlas_jax.quant import QTensor, dequantize


def compute_dtype(x: jax.Array) -> jnp.dtype:
    """Operand dtype of the reference matmuls: f32 stays f32, anything else runs in bf16."""
    return jnp.dtype(jnp.float32) if x.dtype == jnp.float32 else jnp.dtype(jnp.bfloat16)


def group_ids(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """Group of each sorted row; padding rows get ``len(group_sizes)``."""  # [M]
    ends = jnp.cumsum(group_sizes)  # [G]
    return jnp.searchsorted(ends, jnp.arange(num_rows), side="right").astype(jnp.int32)


def grouped_matmul_reference(
    x: jax.Array,  # [M, K]
    w: QTensor,  # [G, N, K]
    group_sizes: jax.Array,  # [G] int32
    bias: jax.Array | None = None,  # [G, N]
) -> jax.Array:  # [M, N] float32
    dtype = compute_dtype(x)
    wt = jnp.swapaxes(dequantize(w, dtype=dtype), -1, -2)  # [G, K, N]
    out = jax.lax.ragged_dot(
        x.astype(dtype), wt, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
    gid = group_ids(group_sizes, x.shape[0])  # [M]
    valid = (gid < w.shape[0])[:, None]  # [M, 1]
    if bias is not None:
        out = out + jnp.take(bias.astype(jnp.float32), gid, axis=0, mode="fill", fill_value=0)
    return jnp.where(valid, out, 0.0)


def _check(x: jax.Array, w: QTensor, group_sizes: jax.Array, bias: jax.Array | None) -> None:
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


def grouped_matmul(
    x: jax.Array,  # [M, K]
    w: QTensor,  # [G, N, K]
    group_sizes: jax.Array,  # [G] int32, sum <= M
    *,
    bias: jax.Array | None = None,  # [G, N]
    kernels: KernelConfig | None = None,
) -> jax.Array:  # [M, N] float32
    """Grouped matmul over rows sorted by group, float32 out (padding rows are zero)."""
    _check(x, w, group_sizes, bias)
    backend = (kernels or KernelConfig()).grouped_matmul
    match resolve_backend("grouped_matmul", backend, pallas_available=False):
        case Backend.XLA:
            return grouped_matmul_reference(x, w, group_sizes, bias)
        case backend:
            raise NotImplementedError(
                f"grouped_matmul backend {backend.value!r}: the Pallas grouped-matmul kernel is "
                "not wired in yet; use KernelConfig(grouped_matmul='xla')")
