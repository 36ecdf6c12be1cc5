"""MoE layer: pure routers, dispatch, expert MLPs and ``moe_forward``."""

from atlas_jax.moe.layer import moe_forward
from atlas_jax.moe.parallel import load_moe_layer_sharded, shard
from atlas_jax.moe.params import MoEParams, init_params
from atlas_jax.moe.routing import Routing, route

__all__ = ["MoEParams", "Routing", "init_params", "load_moe_layer_sharded", "moe_forward", "route",
           "shard"]
