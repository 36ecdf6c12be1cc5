"""atlas_jax: functional JAX/Pallas layers for Mixture-of-Experts LLM inference.

Public names (see ../shared/DESIGN.md for the contract): the config dataclasses and ``KVDtype``,
``moe_forward``, ``PagedKVCache``, and the submodules ``attention``, ``checkpoint``, ``config``,
``models``, ``moe``, ``ops`` and ``quant``.
"""

from atlas_jax import attention, checkpoint, config, models, moe, ops, quant
from atlas_jax.attention import PagedKVCache
from atlas_jax.config import AttentionConfig, KernelConfig, KVDtype, MoEConfig, RopeConfig
from atlas_jax.moe import moe_forward

__all__ = [
    "AttentionConfig",
    "PagedKVCache",
    "attention",
    "checkpoint",
    "KVDtype",
    "KernelConfig",
    "MoEConfig",
    "RopeConfig",
    "config",
    "models",
    "moe",
    "moe_forward",
    "ops",
    "quant",
]
