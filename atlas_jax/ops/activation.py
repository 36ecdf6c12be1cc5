"""Gated activations of expert MLPs: ``act(gate) * up`` over a fused gate_up product."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from atlas_jax.config import Activation, GateUpLayout, MoEConfig

GPT_OSS_ALPHA = 1.702


@dataclasses.dataclass(frozen=True)
class GateUp:
    """The epilogue of a gate_up matmul: how to split its output and which activation to apply."""

    activation: Activation = Activation.SILU
    layout: GateUpLayout = GateUpLayout.CONCATENATED  # rows of gate_up [.., 2I, H]
    limit: float | None = None  # SiLU: gate <= l, |up| <= l (DeepSeek-V4); gpt-oss: its limit

    @classmethod
    def of(cls, cfg: MoEConfig, layout: GateUpLayout | None = None) -> GateUp:
        return cls(cfg.activation, layout or cfg.gate_up_layout, cfg.swiglu_limit)


def split_gate_up(h: jax.Array, layout: GateUpLayout) -> tuple[jax.Array, jax.Array]:
    """[..., 2I] -> gate [..., I], up [..., I]."""
    match layout:
        case GateUpLayout.CONCATENATED:
            return jnp.split(h, 2, axis=-1)
        case GateUpLayout.INTERLEAVED:
            return h[..., 0::2], h[..., 1::2]


def gated_activation(h: jax.Array, e: GateUp) -> jax.Array:
    """``act(gate) * up`` in float32.  [..., 2I] -> [..., I]"""
    gate, up = split_gate_up(h.astype(jnp.float32), e.layout)
    limit = e.limit
    match e.activation:
        case Activation.SILU:
            if limit is not None:  # DeepSeek-V4: gate <= limit, |up| <= limit
                gate = jnp.minimum(gate, limit)
                up = jnp.clip(up, -limit, limit)
            return jax.nn.silu(gate) * up
        case Activation.GELU_TANH:
            return jax.nn.gelu(gate, approximate=True) * up
        case Activation.GPT_OSS:
            gate = jnp.minimum(gate, limit)
            up = jnp.clip(up, -limit, limit)
            return (up + 1.0) * (gate * jax.nn.sigmoid(GPT_OSS_ALPHA * gate))
