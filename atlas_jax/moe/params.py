"""MoE layer parameters: a pytree that carries its MoEConfig as static metadata."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from atlas_jax.config import Format, MoEConfig
from atlas_jax.quant import QTensor, quantize


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEParams:
    """Weights of one MoE layer (E routed experts, Z zero experts, H hidden, I expert width).

    Optional arrays are present exactly when the config asks for them (checked on construction).
    """

    router: jax.Array  # [E+Z, H] router (gate) weight
    gate_up: QTensor  # [E, 2I, H] fused gate|up (layout per config.gate_up_layout)
    down: QTensor  # [E, H, I]
    router_bias: jax.Array | None = None  # [E+Z] logits bias (gpt-oss)
    selection_bias: jax.Array | None = None  # [E+Z] selection-only bias (e_score_correction_bias)
    tid2eid: jax.Array | None = None  # [V, k] int32 hash-routing table (DeepSeek-V4)
    router_scale: jax.Array | None = None  # [H] router input scale (Gemma-4)
    per_expert_scale: jax.Array | None = None  # [E] routing weight scale (Gemma-4)
    pre_expert_norm: jax.Array | None = None  # [H] RMSNorm weight of the experts' input (Gemma-4)
    gate_up_bias: jax.Array | None = None  # [E, 2I] (gpt-oss)
    down_bias: jax.Array | None = None  # [E, H] (gpt-oss)
    shared_gate_up: QTensor | None = None  # [2Is, H] shared expert, its own format
    shared_down: QTensor | None = None  # [H, Is]
    shared_gate: jax.Array | None = None  # [1, H] shared-expert gate (sigmoid)
    config: MoEConfig = dataclasses.field(default=None, metadata=dict(static=True))  # type: ignore

    def __post_init__(self) -> None:
        cfg = self.config
        if not isinstance(cfg, MoEConfig):
            raise TypeError(f"MoEParams.config must be a MoEConfig, got {type(cfg).__name__}")
        if not _is_concrete_tree(self):
            return  # pytree reconstruction inside transformations: leaves may be placeholders
        e, z, h, i = cfg.num_experts, cfg.num_zero_experts, cfg.hidden_size, cfg.intermediate_size
        s = cfg.shared_intermediate_size
        expect = {
            "router": (e + z, h),
            "gate_up": (e, 2 * i, h),
            "down": (e, h, i),
            "router_bias": (e + z,) if cfg.router_bias else None,
            "selection_bias": (e + z,) if cfg.selection_bias else None,
            "tid2eid": (cfg.hash_vocab_size, cfg.top_k) if cfg.hash_routing else None,
            "router_scale": (h,) if cfg.gemma_router else None,
            "per_expert_scale": (e,) if cfg.per_expert_scale else None,
            "pre_expert_norm": (h,) if cfg.pre_expert_norm else None,
            "gate_up_bias": (e, 2 * i) if cfg.expert_bias else None,
            "down_bias": (e, h) if cfg.expert_bias else None,
            "shared_gate_up": (2 * s, h) if s else None,
            "shared_down": (h, s) if s else None,
            "shared_gate": (1, h) if cfg.shared_expert_gate else None,
        }
        for name, shape in expect.items():
            value = getattr(self, name)
            if shape is None:
                if value is not None:
                    raise ValueError(f"MoEParams.{name}: the config does not use it, but it is "
                                     f"set (shape {_shape(value)})")
                continue
            if value is None:
                raise ValueError(f"MoEParams.{name}: the config needs shape {shape}, got None")
            if tuple(_shape(value)) != shape:
                raise ValueError(
                    f"MoEParams.{name}: expected shape {shape}, got {_shape(value)}")
        formats = {"gate_up": cfg.expert_format, "down": cfg.expert_format,
                   "shared_gate_up": cfg.shared_format, "shared_down": cfg.shared_format}
        for name, fmt in formats.items():
            value = getattr(self, name)
            if value is not None and value.format is not fmt:
                raise ValueError(f"MoEParams.{name}: config says format {fmt.value}, "
                                 f"the QTensor is {value.format.value}")


def _shape(value) -> tuple[int, ...]:
    return tuple(value.shape)


def _is_concrete_tree(params: MoEParams) -> bool:
    leaves = jax.tree_util.tree_leaves(params)
    return all(hasattr(leaf, "shape") for leaf in leaves)


def init_params(key: jax.Array, cfg: MoEConfig, *, dtype=jnp.bfloat16) -> MoEParams:
    """Random parameters for ``cfg`` (weights ~ N(0, 1/fan_in)), experts in ``cfg``'s formats.

    ``dtype`` is the dtype of the unquantized arrays (router, biases, BF16-format experts).
    """
    e, z, h, i = cfg.num_experts, cfg.num_zero_experts, cfg.hidden_size, cfg.intermediate_size
    s = cfg.shared_intermediate_size
    keys = iter(jax.random.split(key, 16))

    def normal(shape, fan_in, scale=1.0):
        return (jax.random.normal(next(keys), shape, jnp.float32) * scale / fan_in**0.5)

    def weight(shape, fan_in, fmt):
        block = cfg.fp8_block if fmt is Format.FP8_BLOCK else None
        return quantize(normal(shape, fan_in), fmt, block_size=block, dtype=dtype)

    def maybe(flag, make):
        return make() if flag else None

    return MoEParams(
        router=normal((e + z, h), h).astype(dtype),
        gate_up=weight((e, 2 * i, h), h, cfg.expert_format),
        down=weight((e, h, i), i, cfg.expert_format),
        router_bias=maybe(cfg.router_bias, lambda: normal((e + z,), 1, 0.1).astype(dtype)),
        selection_bias=maybe(cfg.selection_bias, lambda: normal((e + z,), 1, 0.1)),
        tid2eid=maybe(cfg.hash_routing, lambda: _random_hash_table(next(keys), cfg)),
        router_scale=maybe(cfg.gemma_router, lambda: 1.0 + normal((h,), 1, 0.1)),
        per_expert_scale=maybe(cfg.per_expert_scale, lambda: 1.0 + normal((e,), 1, 0.1)),
        pre_expert_norm=maybe(cfg.pre_expert_norm, lambda: 1.0 + normal((h,), 1, 0.1)),
        gate_up_bias=maybe(cfg.expert_bias, lambda: normal((e, 2 * i), 1, 0.1).astype(dtype)),
        down_bias=maybe(cfg.expert_bias, lambda: normal((e, h), 1, 0.1).astype(dtype)),
        shared_gate_up=maybe(s, lambda: weight((2 * s, h), h, cfg.shared_format)),
        shared_down=maybe(s, lambda: weight((h, s), s, cfg.shared_format)),
        shared_gate=maybe(cfg.shared_expert_gate, lambda: normal((1, h), h).astype(dtype)),
        config=cfg,
    )


def _random_hash_table(key: jax.Array, cfg: MoEConfig) -> jax.Array:
    """[V, k] distinct expert ids per token id."""
    scores = jax.random.uniform(key, (cfg.hash_vocab_size, cfg.num_experts))
    return jax.lax.top_k(scores, cfg.top_k)[1].astype(jnp.int32)
