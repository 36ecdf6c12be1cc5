"""Attention layer parameters: a pytree that carries its AttentionConfig as static metadata,
random init, and loading from transformers' state-dict names."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from atlas_jax._safetensors import CheckpointError
from atlas_jax.config import AttentionConfig, Format, NormStyle
from atlas_jax.quant import QTensor, quantize
from atlas_jax.quant.stored import linear_from_tensors


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionParams:
    """Weights of one attention layer (H hidden, Hq query heads, Hk kv heads, D head_dim,
    Nq = config.q_proj_rows). Weights are ``[out, in]`` QTensors, q_proj in
    ``config.weight_format``; k/v/o carry their own format (a checkpoint may store them
    otherwise: each is loaded as stored). Optional arrays are present exactly when the config
    asks for them (checked on construction)."""

    q_proj: QTensor  # [Nq, H] per head [q_h | gate_h] when the config has an output gate
    k_proj: QTensor  # [Hk*D, H]
    v_proj: QTensor  # [Hk*D, H]
    o_proj: QTensor  # [H, Hq*D]
    q_bias: jax.Array | None = None  # [Nq] (config.qkv_bias)
    k_bias: jax.Array | None = None  # [Hk*D]
    v_bias: jax.Array | None = None  # [Hk*D]
    o_bias: jax.Array | None = None  # [H] (config.o_bias)
    q_norm: jax.Array | None = None  # [D] per-head RMSNorm weight (config.qk_norm)
    k_norm: jax.Array | None = None  # [D]
    sinks: jax.Array | None = None  # [Hq] sink logit per query head (config.sinks)
    config: AttentionConfig = dataclasses.field(default=None, metadata=dict(static=True))  # type: ignore

    def __post_init__(self) -> None:
        cfg = self.config
        if not isinstance(cfg, AttentionConfig):
            raise TypeError(f"AttentionParams.config must be an AttentionConfig, "
                            f"got {type(cfg).__name__}")
        if not all(hasattr(x, "shape") for x in jax.tree_util.tree_leaves(self)):
            return  # pytree reconstruction inside transformations: leaves may be placeholders
        for name, shape in expected_shapes(cfg).items():
            value = getattr(self, name)
            if shape is None:
                if value is not None:
                    raise ValueError(f"AttentionParams.{name}: the config does not use it, but "
                                     f"it is set (shape {tuple(value.shape)})")
            elif value is None:
                raise ValueError(f"AttentionParams.{name}: the config needs shape {shape}, "
                                 f"got None")
            elif tuple(value.shape) != shape:
                raise ValueError(f"AttentionParams.{name}: expected shape {shape}, "
                                 f"got {tuple(value.shape)}")
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            qt = getattr(self, name)
            if not isinstance(qt, QTensor):
                raise TypeError(f"AttentionParams.{name}: expected a QTensor, "
                                f"got {type(qt).__name__}")
            if name == "q_proj" and qt.format is not cfg.weight_format:
                raise ValueError(f"AttentionParams.{name}: config says format "
                                 f"{cfg.weight_format.value}, the QTensor is {qt.format.value}")


def expected_shapes(cfg: AttentionConfig) -> dict[str, tuple[int, ...] | None]:
    """Shape of every field for ``cfg`` (None: absent)."""
    h, d, hq, hk = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    nq = cfg.q_proj_rows
    return {
        "q_proj": (nq, h),
        "k_proj": (hk * d, h),
        "v_proj": (hk * d, h),
        "o_proj": (h, hq * d),
        "q_bias": (nq,) if cfg.qkv_bias else None,
        "k_bias": (hk * d,) if cfg.qkv_bias else None,
        "v_bias": (hk * d,) if cfg.qkv_bias else None,
        "o_bias": (h,) if cfg.o_bias else None,
        "q_norm": (d,) if cfg.qk_norm else None,
        "k_norm": (d,) if cfg.qk_norm else None,
        "sinks": (hq,) if cfg.sinks else None,
    }


def init_params(key: jax.Array, cfg: AttentionConfig, *, dtype=jnp.bfloat16) -> AttentionParams:
    """Random parameters for ``cfg``: weights ~ N(0, 1/fan_in) in ``cfg.weight_format``, biases
    and sinks ~ N(0, 0.1^2), norm weights around their identity (1 for ``x*w``, 0 for
    ``x*(1+w)``). ``dtype``: the unquantized arrays and BF16-format weights (None: float32).
    All fields come from one normal draw (cheap to compile), sliced in field order."""
    dtype = jnp.float32 if dtype is None else dtype
    shapes = {name: shape for name, shape in expected_shapes(cfg).items() if shape is not None}
    sizes = [math.prod(shape) for shape in shapes.values()]
    draws = jnp.split(jax.random.normal(key, (sum(sizes),), jnp.float32), np.cumsum(sizes)[:-1])
    fields: dict = {}
    for (name, shape), z in zip(shapes.items(), draws, strict=True):
        z = z.reshape(shape)
        if name.endswith("_proj"):
            block = cfg.fp8_block if cfg.weight_format is Format.FP8_BLOCK else None
            fields[name] = quantize(z * shape[1] ** -0.5, cfg.weight_format, block_size=block,
                                    dtype=dtype)
        elif name.endswith("_norm"):
            centre = 1.0 if cfg.norm_style is NormStyle.SCALE else 0.0
            fields[name] = (centre + 0.1 * z).astype(dtype)
        else:
            fields[name] = (0.1 * z).astype(dtype)
    return AttentionParams(**fields, config=cfg)


def from_hf_tensors(get: Callable[[str], np.ndarray], prefix: str, cfg: AttentionConfig,
                    has: Callable[[str], bool] | None = None) -> AttentionParams:
    """Params from transformers' state-dict names under ``prefix`` (e.g.
    ``"model.layers.3.self_attn."``): ``q_proj.weight`` / ``.bias`` (likewise k, v, o),
    ``q_norm.weight``, ``k_norm.weight``, ``sinks``.

    ``get(name)`` returns the array (numpy or ml_dtypes); ``has(name)`` whether it is stored
    (None: whether ``get`` succeeds, i.e. raises no KeyError / CheckpointError). Each projection
    is read in the format it is stored in (``atlas_jax.quant.stored``: BF16 float ``weight``,
    FP8_BLOCK ``weight`` + ``weight_scale_inv`` with block ``cfg.fp8_block``, NVFP4 ModelOpt or
    compressed-tensors, MXFP4 ``weight_blocks`` + ``weight_scales``); the returned config's
    ``weight_format`` is q_proj's. Qwen3-Next's q_proj already holds ``[q_h | gate_h]`` per head.
    """
    if has is None:
        has = _succeeds(get)

    def array(name: str, needed: bool) -> jax.Array | None:
        return jnp.asarray(get(prefix + name)) if needed else None

    weights = {name: linear_from_tensors(get, has, prefix + name, cfg.fp8_block)
               for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    return AttentionParams(
        **weights,
        q_bias=array("q_proj.bias", cfg.qkv_bias),
        k_bias=array("k_proj.bias", cfg.qkv_bias),
        v_bias=array("v_proj.bias", cfg.qkv_bias),
        o_bias=array("o_proj.bias", cfg.o_bias),
        q_norm=array("q_norm.weight", cfg.qk_norm),
        k_norm=array("k_norm.weight", cfg.qk_norm),
        sinks=array("sinks", cfg.sinks),
        config=cfg.replace(weight_format=weights["q_proj"].format),
    )


def _succeeds(get: Callable[[str], np.ndarray]) -> Callable[[str], bool]:
    """``has(name)``: whether ``get(name)`` returns (KeyError / CheckpointError: missing)."""
    def has(name: str) -> bool:
        try:
            get(name)
        except (KeyError, CheckpointError):
            return False
        return True

    return has
