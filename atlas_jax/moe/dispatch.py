"""Dispatch: permute (token, slot) pairs into expert-sorted rows, and back, and combine."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from atlas_jax.moe.routing import Routing


class Permutation(NamedTuple):
    order: jax.Array  # [T*k] pair index of each sorted row (stable sort by expert id)
    token_of_row: jax.Array  # [T*k] token of each sorted row
    group_sizes: jax.Array  # [E] int32 rows per expert; zero-expert pairs sort last, uncounted


def permute(expert_ids: jax.Array, num_experts: int) -> Permutation:
    """Stable sort of the (token, slot) pairs by expert id. ``expert_ids`` [T, k]."""
    t, k = expert_ids.shape
    flat = expert_ids.reshape(-1)  # [T*k]
    key = jnp.where(flat < num_experts, flat, num_experts)  # zero experts after all others
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    return Permutation(order, order // k, group_sizes)


def unpermute(rows: jax.Array, p: Permutation) -> jax.Array:
    """Sorted rows [T*k, H] back to pair order [T*k, H]."""
    return jnp.zeros_like(rows).at[p.order].set(rows, unique_indices=True)


def combine(pairs: jax.Array, x: jax.Array, r: Routing, num_experts: int) -> jax.Array:
    """Weighted sum over the k slots in float32; zero experts contribute ``weight * x``.

    ``pairs`` [T*k, H] expert outputs in pair order, ``x`` [T, H] -> [T, H] float32.
    """
    t, k = r.expert_ids.shape
    pairs = pairs.reshape(t, k, -1).astype(jnp.float32)
    identity = (r.expert_ids >= num_experts)[..., None]  # [T, k, 1]
    pairs = jnp.where(identity, x.astype(jnp.float32)[:, None, :], pairs)
    return jnp.einsum("tk,tkh->th", r.weights.astype(jnp.float32), pairs)
