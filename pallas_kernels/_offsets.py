"""Operand sizes that Pallas' Triton lowering cannot index correctly, and the way around them.

The lowering (jax 0.11.2, ``_compute_offsets_from_indices``) computes element offsets into an
operand in int32 unless the operand spans more than 2**32 bytes. A 1-byte operand (e4m3, packed
FP4, uint8 scales) with more than 2**31 elements therefore gets offsets that wrap negative: the
kernel silently reads the wrong memory, no error. Example: one EP=2 shard of DeepSeek-V3's FP8
gate_up, ``[128, 4096, 7168]`` e4m3 = 3.8e9 bytes (the whole 256-expert stack, 7.5e9 bytes, is
indexed with int64 and is fine). A kernel reads such a weight through ``pair_view`` (half the
elements, same bytes) and rejects any other overflowing operand with ``check_offsets``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

INT32_OFFSET_LIMIT = 2**31  # elements an int32-indexed operand may have
INT64_INDEXED_BYTES = 2**32  # operands larger than this are indexed with int64


def int32_offsets_overflow(shape: tuple[int, ...], dtype) -> bool:
    """Whether the Triton lowering's element offsets into an operand would overflow int32."""
    size = math.prod(shape)
    return size > INT32_OFFSET_LIMIT and size * jnp.dtype(dtype).itemsize <= INT64_INDEXED_BYTES


def pair_view(a: jax.Array) -> jax.Array:
    """``[..., n]`` 1-byte -> ``[..., n/2]`` uint16 holding bytes ``2j`` (low) and ``2j+1``."""
    u8 = jax.lax.bitcast_convert_type(a, jnp.uint8)
    return jax.lax.bitcast_convert_type(u8.reshape(*a.shape[:-1], -1, 2), jnp.uint16)


def bytes_of_pairs(pairs: jax.Array) -> jax.Array:
    """In a kernel: a loaded uint16 ``[r, c]`` tile of ``pair_view`` -> its uint8 bytes
    ``[r, 2c]`` in the original order (tt.join + reshape)."""
    pairs = pairs.astype(jnp.int32)
    r, c = pairs.shape
    return jnp.stack([pairs & 0xFF, pairs >> 8], axis=-1).reshape(r, 2 * c).astype(jnp.uint8)


def pair_view_if_overflowing(name: str, a: jax.Array) -> tuple[jax.Array, bool]:
    """``(pair_view(a), True)`` when ``a``'s int32 offsets would overflow, else ``(a, False)``;
    NotImplementedError when it would need the view but its last dim is odd."""
    if not int32_offsets_overflow(a.shape, a.dtype):
        return a, False
    if a.shape[-1] % 2:
        raise NotImplementedError(
            f"{name}: {tuple(a.shape)} {a.dtype} needs the uint16 view (int32 offsets would "
            f"overflow), which needs an even last dim, got {a.shape[-1]}")
    return pair_view(a), True


def check_offsets(operands: dict) -> None:
    """NotImplementedError naming the first operand (name -> array or None) that overflows."""
    for name, a in operands.items():
        if a is not None and int32_offsets_overflow(a.shape, a.dtype):
            raise NotImplementedError(
                f"{name}: shape {tuple(a.shape)} {a.dtype} has more than {INT32_OFFSET_LIMIT} "
                f"elements in at most {INT64_INDEXED_BYTES} bytes; Pallas' Triton lowering "
                f"would index it with overflowing int32 offsets"
            )
