"""Flax NNX modules over the pure layers, for users who build models from modules.

Each module holds its layer's params pytree (with the layer config as static metadata) in one
``nnx.Param`` and calls the pure function; ``nnx.split`` / ``nnx.jit`` / ``nnx.state`` see the
arrays (QTensor leaves included) and nothing else.

    moe = atlas_jax.nn.MoE(cfg, rngs=nnx.Rngs(0))            # random init from a config
    moe = atlas_jax.nn.MoE.from_checkpoint(path, layer=3)    # one layer of an HF directory
    y = moe(x)                                               # == atlas_jax.moe_forward(...)
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from atlas_jax import attention as attn
from atlas_jax import checkpoint
from atlas_jax.attention import AttentionParams, PagedKVCache
from atlas_jax.config import AttentionConfig, KernelConfig, MoEConfig
from atlas_jax.moe import MoEParams, init_params, moe_forward


class MoE(nnx.Module):
    """An MoE layer: ``__call__`` is :func:`atlas_jax.moe_forward`."""

    def __init__(self, cfg: MoEConfig | None = None, *, rngs: nnx.Rngs | None = None,
                 params: MoEParams | None = None, dtype=jnp.bfloat16,
                 kernels: KernelConfig | None = None):
        """Random params from ``cfg`` and ``rngs``, or the given ``params`` (one or the other)."""
        if params is None:
            if cfg is None or rngs is None:
                raise ValueError("MoE: pass cfg and rngs (random init) or params=")
            params = init_params(rngs.params(), cfg, dtype=dtype)
        elif not isinstance(params, MoEParams):
            raise TypeError(f"MoE: params must be MoEParams, got {type(params).__name__}")
        elif cfg is not None and cfg != params.config:
            raise ValueError("MoE: cfg differs from params.config; pass one of them")
        self.params = nnx.Param(params)
        self.kernels = kernels

    @classmethod
    def from_params(cls, params: MoEParams, *, kernels: KernelConfig | None = None) -> MoE:
        return cls(params=params, kernels=kernels)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, layer: int, *,
                        kernels: KernelConfig | None = None) -> MoE:
        return cls.from_params(checkpoint.load_moe_layer(path, layer), kernels=kernels)

    @property
    def config(self) -> MoEConfig:
        return self.params.get_value().config

    def __call__(self, x: jax.Array, *, token_ids: jax.Array | None = None) -> jax.Array:
        return moe_forward(self.params.get_value(), x, token_ids=token_ids,
                           kernels=self.kernels)


class Attention(nnx.Module):
    """An attention layer over a paged KV cache: ``prefill`` / ``decode`` (and ``__call__`` =
    ``prefill``) are :func:`atlas_jax.attention.prefill` / ``decode``; each returns
    ``(y, new_cache)``."""

    def __init__(self, cfg: AttentionConfig | None = None, *, rngs: nnx.Rngs | None = None,
                 params: AttentionParams | None = None, dtype=jnp.bfloat16,
                 kernels: KernelConfig | None = None):
        """Random params from ``cfg`` and ``rngs``, or the given ``params`` (one or the other)."""
        if params is None:
            if cfg is None or rngs is None:
                raise ValueError("Attention: pass cfg and rngs (random init) or params=")
            params = attn.init_params(rngs.params(), cfg, dtype=dtype)
        elif not isinstance(params, AttentionParams):
            raise TypeError(
                f"Attention: params must be AttentionParams, got {type(params).__name__}")
        elif cfg is not None and cfg != params.config:
            raise ValueError("Attention: cfg differs from params.config; pass one of them")
        self.params = nnx.Param(params)
        self.kernels = kernels

    @classmethod
    def from_params(cls, params: AttentionParams, *,
                    kernels: KernelConfig | None = None) -> Attention:
        return cls(params=params, kernels=kernels)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, layer: int, *,
                        kernels: KernelConfig | None = None) -> Attention:
        return cls.from_params(checkpoint.load_attention_layer(path, layer), kernels=kernels)

    @property
    def config(self) -> AttentionConfig:
        return self.params.get_value().config

    def prefill(self, x, cache: PagedKVCache, block_tables, start_pos, **kw):
        return attn.prefill(self.params.get_value(), x, cache, block_tables, start_pos,
                            kernels=self.kernels, **kw)

    def decode(self, x, cache: PagedKVCache, block_tables, seq_lens, **kw):
        return attn.decode(self.params.get_value(), x, cache, block_tables, seq_lens,
                           kernels=self.kernels, **kw)

    __call__ = prefill
