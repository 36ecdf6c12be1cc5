"""Loading HF model directories (config.json + safetensors, sharded or not) into params pytrees.

Per-layer loads read only that layer's tensors. Expert tensors are stacked to ``[E, ...]``;
gate and up are fused to ``gate_up [E, 2I, H]`` (gate rows first, or interleaved for gpt-oss).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from atlas_jax._safetensors import CheckpointError, SafetensorsFile
from atlas_jax.config import MoEConfig, _text_config
from atlas_jax.moe.params import MoEParams
from atlas_jax.quant import QTensor

__all__ = ["Checkpoint", "CheckpointError", "load_moe_layer"]

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
            self._where = dict.fromkeys(single.keys(), single.path)
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


# -- MoE layers ----------------------------------------------------------------------------------


def _stack(ck: Checkpoint, names: list[str]) -> np.ndarray:
    return np.stack([ck.get(n) for n in names])


def _per_expert(ck: Checkpoint, block: str, e: int, gate: str, up: str, down: str):
    """Per-expert tensors ``{block}experts.{e}.{name}.weight`` -> gate_up [E, 2I, H], down."""
    names = lambda proj: [f"{block}experts.{i}.{proj}.weight" for i in range(e)]  # noqa: E731
    gate_up = np.concatenate([_stack(ck, names(gate)), _stack(ck, names(up))], axis=1)
    return gate_up, _stack(ck, names(down))


def _experts(ck: Checkpoint, block: str, e: int, gate="gate_proj", up="up_proj",
             down="down_proj"):
    """Routed experts, per-expert or already fused ``experts.gate_up_proj [E, 2I, H]``."""
    if ck.has(f"{block}experts.gate_up_proj"):
        return ck.get(f"{block}experts.gate_up_proj"), ck.get(f"{block}experts.down_proj")
    return _per_expert(ck, block, e, gate, up, down)


def _dense(ck: Checkpoint, block: str, gate="gate_proj", up="up_proj", down="down_proj"):
    gate_up = np.concatenate([ck.get(f"{block}{gate}.weight"), ck.get(f"{block}{up}.weight")])
    return gate_up, ck.get(f"{block}{down}.weight")


def _opt(ck: Checkpoint, name: str) -> np.ndarray | None:
    return ck.get(name) if ck.has(name) else None


# Each mapper returns the MoEParams fields of one layer as numpy arrays (gate_up/down unwrapped).
Mapper = Callable[[Checkpoint, str, MoEConfig], dict]


def _map_qwen(ck: Checkpoint, p: str, cfg: MoEConfig) -> dict:
    b = f"{p}mlp."
    _require_router(ck, f"{b}gate.weight", p)
    gate_up, down = _experts(ck, b, cfg.num_experts)
    out = dict(router=ck.get(f"{b}gate.weight"), gate_up=gate_up, down=down)
    if cfg.shared_intermediate_size:
        shared = f"{b}shared_expert." if ck.has(f"{b}shared_expert.gate_proj.weight") \
            else f"{b}shared_experts."
        out["shared_gate_up"], out["shared_down"] = _dense(ck, shared)
    if cfg.shared_expert_gate:
        out["shared_gate"] = ck.get(f"{b}shared_expert_gate.weight")
    if cfg.selection_bias:
        out["selection_bias"] = ck.get(f"{b}gate.e_score_correction_bias")
    return out


def _map_mixtral(ck: Checkpoint, p: str, cfg: MoEConfig) -> dict:
    b = f"{p}block_sparse_moe."
    _require_router(ck, f"{b}gate.weight", p)
    gate_up, down = _experts(ck, b, cfg.num_experts, "w1", "w3", "w2")
    out = dict(router=ck.get(f"{b}gate.weight"), gate_up=gate_up, down=down)
    if cfg.selection_bias:  # MiniMax-M2 keeps it on the block
        out["selection_bias"] = ck.get(f"{b}e_score_correction_bias")
    return out


def _map_longcat(ck: Checkpoint, p: str, cfg: MoEConfig) -> dict:
    b = f"{p}mlp."
    _require_router(ck, f"{b}router.classifier.weight", p)
    gate_up, down = _per_expert(ck, b, cfg.num_experts, "gate_proj", "up_proj", "down_proj")
    return dict(router=ck.get(f"{b}router.classifier.weight"), gate_up=gate_up, down=down,
                selection_bias=ck.get(f"{b}router.e_score_correction_bias"))


def _map_gpt_oss(ck: Checkpoint, p: str, cfg: MoEConfig) -> dict:
    b = f"{p}mlp."
    _require_router(ck, f"{b}router.weight", p)
    # Fused, input-major: gate_up_proj [E, H, 2I] (gate = even columns), down_proj [E, I, H].
    return dict(
        router=ck.get(f"{b}router.weight"),
        router_bias=ck.get(f"{b}router.bias"),
        gate_up=np.swapaxes(ck.get(f"{b}experts.gate_up_proj"), 1, 2),
        down=np.swapaxes(ck.get(f"{b}experts.down_proj"), 1, 2),
        gate_up_bias=ck.get(f"{b}experts.gate_up_proj_bias"),
        down_bias=ck.get(f"{b}experts.down_proj_bias"),
    )


def _map_deepseek_v4(ck: Checkpoint, p: str, cfg: MoEConfig) -> dict:
    b = f"{p}ffn."
    _require_router(ck, f"{b}gate.weight", p)
    gate_up, down = _experts(ck, b, cfg.num_experts, "w1", "w3", "w2")
    out = dict(router=ck.get(f"{b}gate.weight"), gate_up=gate_up, down=down)
    if cfg.hash_routing:
        out["tid2eid"] = ck.get(f"{b}gate.tid2eid").astype(np.int32)
    if cfg.selection_bias:
        out["selection_bias"] = ck.get(f"{b}gate.bias")
    if cfg.shared_intermediate_size:
        out["shared_gate_up"], out["shared_down"] = _dense(ck, f"{b}shared_experts.", "w1", "w3",
                                                           "w2")
    return out


def _map_gemma4(ck: Checkpoint, p: str, cfg: MoEConfig) -> dict:
    _require_router(ck, f"{p}router.proj.weight", p)
    return dict(
        router=ck.get(f"{p}router.proj.weight"),
        router_scale=ck.get(f"{p}router.scale"),
        per_expert_scale=ck.get(f"{p}router.per_expert_scale"),
        pre_expert_norm=ck.get(f"{p}pre_feedforward_layernorm_2.weight"),
        gate_up=ck.get(f"{p}experts.gate_up_proj"),
        down=ck.get(f"{p}experts.down_proj"),
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
    return build_moe_params(fields, cfg, prefix)


def build_moe_params(fields: dict, cfg: MoEConfig, where: str) -> MoEParams:
    """Wrap numpy tensors into MoEParams, checking each shape against the config."""
    out = {}
    for name, value in fields.items():
        if value is None:
            continue
        if isinstance(value, QTensor):
            out[name] = value
        elif name in ("gate_up", "down", "shared_gate_up", "shared_down"):
            out[name] = QTensor.from_float(jnp.asarray(value), dtype=None)  # keep dtype
        else:
            out[name] = jnp.asarray(value)
    try:
        return MoEParams(config=cfg, **out)
    except ValueError as e:
        raise ValueError(f"{where}: checkpoint disagrees with config.json: {e}") from None
