"""MoE layer: pure routers, dispatch, expert MLPs and ``moe_forward``."""

from atlas_jax.moe.layer import moe_forward
from atlas_jax.moe.params import MoEParams, init_params
from atlas_jax.moe.routing import Routing, route

__all__ = ["MoEParams", "Routing", "init_params", "moe_forward", "route"]
