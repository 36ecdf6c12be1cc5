"""Loading HF model directories (config.json + safetensors, sharded or not) into params pytrees.

Per-layer loads read only that layer's tensors. Every linear is read in the format it is stored
in (``atlas_jax.quant.stored``), not the one quantization_config suggests (it excludes modules).
Expert tensors are stacked to ``[E, ...]``; gate and up are fused to ``gate_up [E, 2I, H]``
(gate rows first, or interleaved for gpt-oss).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from atlas_jax._safetensors import CheckpointError, SafetensorsFile
from atlas_jax.attention.params import AttentionParams, from_hf_tensors
from atlas_jax.config import AttentionConfig, MoEConfig, _text_config
from atlas_jax.moe.params import MoEParams
from atlas_jax.quant import QTensor, concat_rows
from atlas_jax.quant.stored import linear_from_tensors, qtensor_from_arrays, stored_arrays

__all__ = ["Checkpoint", "CheckpointError", "load_attention_layer", "load_moe_layer"]

# Where the decoder layers live, by the prefix of their tensor names.
_LAYER_PREFIXES = ("model.layers.", "model.language_model.layers.", "language_model.model.layers.",
                   "layers.")


class Checkpoint:
    """An HF model directory: config.json and lazily opened safetensors files."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{self.path}: no config.json (is this an HF model directory?)")
        self.config = json.loads(cfg_path.read_text())
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no weight_map")
            self._where = {name: self.path / file for name, file in weight_map.items()}
        elif (self.path / "model.safetensors").is_file():
            single = SafetensorsFile(self.path / "model.safetensors")
            self._files = {single.path: single}
            self._where = dict.fromkeys(single.names(), single.path)
        else:
            raise CheckpointError(
                f"{self.path}: neither model.safetensors nor model.safetensors.index.json")
        self._files: dict[Path, SafetensorsFile] = getattr(self, "_files", {})
        self.layer_prefix = self._find_layer_prefix()

    # -- tensors ---------------------------------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self._where

    def _file(self, name: str) -> SafetensorsFile:
        path = self._where[name]
        if path not in self._files:
            self._files[path] = SafetensorsFile(path)
        return self._files[path]

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"tensor {name!r} not found in {self._expected_file(name)}")
        f = self._file(name)
        if name not in f.entries:
            raise CheckpointError(f"tensor {name!r} not found in {f.path} (the index lists it)")
        return f.get(name)

    def _expected_file(self, name: str) -> str:
        files = sorted({p.name for p in self._where.values()})
        return f"{self.path} (files: {', '.join(files)})"

    @property
    def tensors_read(self) -> int:
        return sum(f.reads for f in self._files.values())

    # -- layers ----------------------------------------------------------------------------------

    def _find_layer_prefix(self) -> str:
        for prefix in _LAYER_PREFIXES:
            if any(name.startswith(prefix) for name in self._where):
                return prefix
        return _LAYER_PREFIXES[0]

    @property
    def num_layers(self) -> int:
        text = _text_config(self.config)
        return int(text.get("num_hidden_layers") or text.get("num_layers") or 0)  # LongCat: latter

    def layer(self, index: int) -> str:
        """Tensor-name prefix of decoder layer ``index``, range-checked."""
        n = self.num_layers
        if not isinstance(index, int) or not 0 <= index < n:
            raise ValueError(f"layer {index} out of range: the model has {n} layers (0..{n - 1})")
        return f"{self.layer_prefix}{index}."


# -- linears in any stored format (atlas_jax.quant.stored) ---------------------------------------


def _linears(ck: Checkpoint, names: list[str], block: tuple[int, int]) -> QTensor:
    """Linears ``names`` (one per expert) stacked to ``[E, N, K]``."""
    parts = [stored_arrays(ck.get, ck.has, n) for n in names]
    formats = {f for f, _ in parts}
    if len(formats) != 1:
        raise CheckpointError(f"{names[0]} ...: experts stored in mixed formats "
                              f"{sorted(f.value for f in formats)}")
    stacked = {k: np.stack([a[k] for _, a in parts]) for k in parts[0][1]}
    return qtensor_from_arrays(formats.pop(), stacked, block)


def _linear(ck: Checkpoint, name: str, block: tuple[int, int]) -> QTensor:
    return linear_from_tensors(ck.get, ck.has, name, block)


def _gate_up(gate: QTensor, up: QTensor) -> QTensor:
    return concat_rows(gate, up)


def _experts(ck: Checkpoint, block: str, cfg: MoEConfig, gate="gate_proj", up="up_proj",
             down="down_proj") -> tuple[QTensor, QTensor]:
    """Routed experts ``[E, 2I, H]`` and ``[E, H, I]``: per-expert linears, or already fused
    ``experts.gate_up_proj [E, 2I, H]`` (float) / ``experts.gate_up_proj_blocks`` (MXFP4)."""
    fused = f"{block}experts."
    if ck.has(f"{fused}gate_up_proj_blocks"):
        return tuple(QTensor.from_mxfp4(ck.get(f"{fused}{n}_blocks"), ck.get(f"{fused}{n}_scales"))
                     for n in ("gate_up_proj", "down_proj"))
    if ck.has(f"{fused}gate_up_proj"):
        return tuple(QTensor.from_float(jnp.asarray(ck.get(f"{fused}{n}")), dtype=None)
                     for n in ("gate_up_proj", "down_proj"))
    e, b = cfg.num_experts, cfg.fp8_block
    names = lambda proj: [f"{block}experts.{i}.{proj}" for i in range(e)]  # noqa: E731
    gate_up = _gate_up(_linears(ck, names(gate), b), _linears(ck, names(up), b))
    return gate_up, _linears(ck, names(down), b)


def _dense(ck: Checkpoint, block: str, cfg: MoEConfig, gate="gate_proj", up="up_proj",
           down="down_proj") -> tuple[QTensor, QTensor]:
    b = cfg.fp8_block
    return (_gate_up(_linear(ck, f"{block}{gate}", b), _linear(ck, f"{block}{up}", b)),
            _linear(ck, f"{block}{down}", b))


def _opt(ck: Checkpoint, name: str) -> np.ndarray | None:
    return ck.get(name) if ck.has(name) else None


# Each mapper returns the MoEParams fields of one layer as numpy arrays (gate_up/down unwrapped).
Mapper = Callable[[Checkpoint, str, MoEConfig], dict]


def _map_qwen(ck: Checkpoint, p: str, cfg: MoEConfig) -> dict:
    b = f"{p}mlp."
    _require_router(ck, f"{b}gate.weight", p)
    gate_up, down = _experts(ck, b, cfg)
    out = dict(router=ck.get(f"{b}gate.weight"), gate_up=gate_up, down=down)
    if cfg.shared_intermediate_size:
        shared = f"{b}shared_expert." if ck.has(f"{b}shared_expert.gate_proj.weight") \
            else f"{b}shared_experts."
        out["shared_gate_up"], out["shared_down"] = _dense(ck, shared, cfg)
    if cfg.shared_expert_gate:
        out["shared_gate"] = ck.get(f"{b}shared_expert_gate.weight")
    if cfg.selection_bias:
        out["selection_bias"] = ck.get(f"{b}gate.e_score_correction_bias")
    return out


def _map_mixtral(ck: Checkpoint, p: str, cfg: MoEConfig) -> dict:
    b = f"{p}block_sparse_moe."
    _require_router(ck, f"{b}gate.weight", p)
    gate_up, down = _experts(ck, b, cfg, "w1", "w3", "w2")
    out = dict(router=ck.get(f"{b}gate.weight"), gate_up=gate_up, down=down)
    if cfg.selection_bias:  # MiniMax-M2 keeps it on the block
        out["selection_bias"] = ck.get(f"{b}e_score_correction_bias")
    return out


def _map_longcat(ck: Checkpoint, p: str, cfg: MoEConfig) -> dict:
    b = f"{p}mlp."
    _require_router(ck, f"{b}router.classifier.weight", p)
    gate_up, down = _experts(ck, b, cfg)
    return dict(router=ck.get(f"{b}router.classifier.weight"), gate_up=gate_up, down=down,
                selection_bias=ck.get(f"{b}router.e_score_correction_bias"))


def _map_gpt_oss(ck: Checkpoint, p: str, cfg: MoEConfig) -> dict:
    b = f"{p}mlp."
    _require_router(ck, f"{b}router.weight", p)
    if ck.has(f"{b}experts.gate_up_proj_blocks"):  # MXFP4, out-major [E, N, K/32, 16]
        gate_up, down = _experts(ck, b, cfg)
    else:  # float, input-major: gate_up_proj [E, H, 2I] (gate = even columns), down [E, I, H]
        gate_up, down = (QTensor.from_float(jnp.swapaxes(ck.get(f"{b}experts.{n}"), 1, 2),
                                            dtype=None) for n in ("gate_up_proj", "down_proj"))
    return dict(
        router=ck.get(f"{b}router.weight"),
        router_bias=ck.get(f"{b}router.bias"),
        gate_up=gate_up,
        down=down,
        gate_up_bias=ck.get(f"{b}experts.gate_up_proj_bias"),
        down_bias=ck.get(f"{b}experts.down_proj_bias"),
    )


def _map_deepseek_v4(ck: Checkpoint, p: str, cfg: MoEConfig) -> dict:
    b = f"{p}ffn."
    _require_router(ck, f"{b}gate.weight", p)
    gate_up, down = _experts(ck, b, cfg, "w1", "w3", "w2")
    out = dict(router=ck.get(f"{b}gate.weight"), gate_up=gate_up, down=down)
    if cfg.hash_routing:
        out["tid2eid"] = ck.get(f"{b}gate.tid2eid").astype(np.int32)
    if cfg.selection_bias:
        out["selection_bias"] = ck.get(f"{b}gate.bias")
    if cfg.shared_intermediate_size:
        out["shared_gate_up"], out["shared_down"] = _dense(ck, f"{b}shared_experts.", cfg,
                                                           "w1", "w3", "w2")
    return out


def _map_gemma4(ck: Checkpoint, p: str, cfg: MoEConfig) -> dict:
    _require_router(ck, f"{p}router.proj.weight", p)
    return dict(
        router=ck.get(f"{p}router.proj.weight"),
        router_scale=ck.get(f"{p}router.scale"),
        per_expert_scale=ck.get(f"{p}router.per_expert_scale"),
        pre_expert_norm=ck.get(f"{p}pre_feedforward_layernorm_2.weight"),
        **dict(zip(("gate_up", "down"), _experts(ck, p, cfg), strict=True)),
    )


_MOE_MAPPERS: dict[str, Mapper] = {
    "qwen3_moe": _map_qwen,
    "qwen2_moe": _map_qwen,
    "qwen3_next": _map_qwen,
    "deepseek_v3": _map_qwen,
    "mixtral": _map_mixtral,
    "minimax_m2": _map_mixtral,
    "longcat_flash": _map_longcat,
    "gpt_oss": _map_gpt_oss,
    "deepseek_v4": _map_deepseek_v4,
    "gemma4": _map_gemma4,
}


def _require_router(ck: Checkpoint, name: str, layer_prefix: str) -> None:
    if not ck.has(name):
        dense = any(n.startswith(layer_prefix) and ("mlp." in n or "ffn." in n)
                    for n in ck._where)
        what = "it has a dense MLP" if dense else "no MoE tensors were found for it"
        raise ValueError(f"layer {layer_prefix!r} is not an MoE layer ({what}; expected router "
                         f"tensor {name!r})")


def moe_config(ck: Checkpoint, layer: int | None = None) -> MoEConfig:
    return MoEConfig.from_hf_config(ck.config, layer=layer)


def load_moe_layer(path: str | os.PathLike | Checkpoint, layer: int) -> MoEParams:
    """MoEParams of decoder layer ``layer`` of an HF directory, in the checkpoint's dtype.

    Reads only that layer's tensors.
    """
    ck = path if isinstance(path, Checkpoint) else Checkpoint(path)
    prefix = ck.layer(layer)
    cfg = moe_config(ck, layer)
    model_type = ck.config.get("model_type")
    fields = _MOE_MAPPERS[model_type](ck, prefix, cfg)
    # The stored formats decide (quantization configs exclude some modules, e.g. shared experts).
    shared = fields.get("shared_gate_up")
    cfg = cfg.replace(
        expert_format=fields["gate_up"].format,
        shared_expert_format=shared.format if shared is not None else None,
    )
    return build_moe_params(fields, cfg, prefix)


def build_moe_params(fields: dict, cfg: MoEConfig, where: str) -> MoEParams:
    """MoEParams from QTensors and numpy arrays, every shape checked against the config."""
    out = {name: v if isinstance(v, QTensor) else jnp.asarray(v)
           for name, v in fields.items() if v is not None}
    try:
        return MoEParams(config=cfg, **out)
    except ValueError as e:
        raise ValueError(f"{where}: checkpoint disagrees with config.json: {e}") from None


# -- attention layers ----------------------------------------------------------------------------


def attention_config(ck: Checkpoint, layer: int) -> AttentionConfig:
    """The AttentionConfig of decoder layer ``layer`` (range-checked), by ``layer_types`` where
    config.json has it: ``sliding_attention`` layers get ``sliding_window``, ``full_attention``
    layers none; a layer without softmax attention (Qwen3-Next ``linear_attention``) raises."""
    ck.layer(layer)
    cfg = AttentionConfig.from_hf_config(ck.config)
    text = _text_config(ck.config)
    types = text.get("layer_types")
    if not types:
        return cfg
    if len(types) != ck.num_layers:
        raise ValueError(f"config.json: layer_types has {len(types)} entries, expected "
                         f"num_hidden_layers={ck.num_layers}")
    match types[layer]:
        case "full_attention":
            return cfg.replace(sliding_window=None)
        case "sliding_attention":
            window = text.get("sliding_window")
            if not window:
                raise ValueError(f"config.json: layer {layer} is a sliding_attention layer, but "
                                 f"sliding_window is {window!r}")
            return cfg.replace(sliding_window=window)
        case "linear_attention":
            raise ValueError(f"layer {layer} has no full attention: layer_types[{layer}] is "
                             f"'linear_attention' (a linear-attention layer); full-attention "
                             f"layers: {[i for i, t in enumerate(types) if t == 'full_attention']}")
        case other:
            raise ValueError(f"config.json: layer_types[{layer}] is {other!r}, expected "
                             "'full_attention', 'sliding_attention' or 'linear_attention'")


def load_attention_layer(path: str | os.PathLike | Checkpoint, layer: int) -> AttentionParams:
    """AttentionParams of decoder layer ``layer`` of an HF directory (``self_attn.*``), each
    projection in the format it is stored in (``config.weight_format``: q_proj's), arrays in
    the checkpoint's dtype. Reads only that layer's tensors."""
    ck = path if isinstance(path, Checkpoint) else Checkpoint(path)
    prefix = f"{ck.layer(layer)}self_attn."
    cfg = attention_config(ck, layer)
    try:
        return from_hf_tensors(ck.get, prefix, cfg, has=ck.has)
    except CheckpointError:
        raise
    except ValueError as e:
        raise ValueError(f"{prefix}: checkpoint disagrees with config.json: {e}") from None
