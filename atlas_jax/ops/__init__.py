"""The kernel boundary: each op has an "xla" reference and a "pallas" implementation."""

from atlas_jax.ops.grouped_matmul import grouped_matmul, grouped_matmul_reference
from atlas_jax.ops.moe_decode import decode_backend as moe_decode_backend
from atlas_jax.ops.moe_decode import moe_decode, moe_decode_reference
from atlas_jax.ops.routing import route_pallas, router_backend

__all__ = ["grouped_matmul", "grouped_matmul_reference", "moe_decode", "moe_decode_backend",
           "moe_decode_reference", "route_pallas", "router_backend"]
