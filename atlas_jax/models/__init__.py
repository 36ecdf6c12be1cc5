"""Small complete models built from the layers: ``load(path)`` reads an HF directory.

    model = aj.models.load("checkpoints/qwen3-moe-tiny")
    logits = model.forward(input_ids)                       # [B, S, V], one prefill
    tokens = model.generate(input_ids, max_new_tokens=16)   # [B, 16], greedy, paged KV decode

Supported ``model_type`` s: ``qwen3_moe`` (``atlas_jax.models.qwen3_moe``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
from tqdm.auto import tqdm

from atlas_jax._safetensors import CheckpointError, SafetensorsFile
from atlas_jax.checkpoint import Checkpoint
from atlas_jax.config import ActQuant, KernelConfig, KVDtype
from atlas_jax.models import qwen3_moe
from atlas_jax.models.qwen3_moe import Qwen3MoE

__all__ = ["SUPPORTED_MODEL_TYPES", "Qwen3MoE", "load", "qwen3_moe"]

_LOADERS = {"qwen3_moe": qwen3_moe.load}
SUPPORTED_MODEL_TYPES = tuple(sorted(_LOADERS))


def load(path: str | os.PathLike, *, kv_dtype: KVDtype | str = KVDtype.BF16,
         kernels: KernelConfig | str | None = None, dtype=jnp.bfloat16,
         max_seq_len: int | None = None, progress: bool = True,
         act_quant: ActQuant | str = ActQuant.NONE) -> Qwen3MoE:
    """The model in HF directory ``path`` (config.json + *.safetensors, sharded or not; weights
    BF16/F32, FP8 block, NVFP4 or MXFP4, each linear as stored).

    ``kv_dtype``: the paged KV cache's storage (``KVDtype`` or its value: "bf16", "fp8",
    "nvfp4", "float32"). ``kernels``: a ``KernelConfig``, or "auto" / "xla" / "pallas" for
    every op. ``dtype``: activations and unquantized weights (float32 for reference numerics).
    ``max_seq_len``: a fixed KV capacity a sequence (prompt + new tokens), so that the decode
    step compiles once per batch-size bucket (None: capacity buckets, powers of two pages).
    ``progress``: a progress bar over the bytes read. ``act_quant``: "fp8" runs the MoE layers'
    FP8-block experts W8A8 (``MoEConfig.gate_up_act_quant`` / ``down_act_quant``: e4m3
    activations per token per 128, as transformers' FP8 layers on a GPU); the default runs
    them weight-only, as stored (a ValueError for a checkpoint whose experts are not FP8).

    Raises ``NotImplementedError`` for a model_type other than the supported ones, and
    ``CheckpointError`` (a ValueError) for a directory that is not an HF safetensors model.
    """
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json (is this an HF model directory?)")
    config = json.loads(cfg_file.read_text())
    model_type = config.get("model_type")
    if model_type not in _LOADERS:
        raise NotImplementedError(
            f"{path}: model_type {model_type!r} is not supported by atlas_jax.models.load; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}")
    try:
        kv_dtype = KVDtype(kv_dtype)
    except ValueError:
        raise ValueError(f"kv_dtype: expected one of {[k.value for k in KVDtype]}, "
                         f"got {kv_dtype!r}") from None
    try:
        act_quant = ActQuant(act_quant)
    except ValueError:
        raise ValueError(f"act_quant: expected one of {[a.value for a in ActQuant]}, "
                         f"got {act_quant!r}") from None
    ck = _ProgressCheckpoint(path, progress)
    try:
        return _LOADERS[model_type](ck, kv_dtype=kv_dtype, kernels=_kernels(kernels),
                                    dtype=dtype, max_seq_len=max_seq_len, act_quant=act_quant)
    finally:
        ck.bar.close()


def _kernels(kernels: KernelConfig | str | None) -> KernelConfig | None:
    if kernels is None or isinstance(kernels, KernelConfig):
        return kernels
    if isinstance(kernels, str):
        return KernelConfig(grouped_matmul=kernels, paged_attention=kernels, router=kernels)
    raise TypeError(f"kernels: expected a KernelConfig, 'auto', 'xla', 'pallas' or None, "
                    f"got {type(kernels).__name__}")


class _ProgressCheckpoint(Checkpoint):
    """A Checkpoint whose reads advance a tqdm bar over the bytes of its tensors."""

    def __init__(self, path: Path, progress: bool):
        super().__init__(path)
        files = [path / "model.safetensors"]
        index = path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        headers = [SafetensorsFile(f).entries for f in files if f.is_file()]
        self.num_tensors = sum(len(h) for h in headers)
        total = sum(e["data_offsets"][1] - e["data_offsets"][0] for h in headers
                    for e in h.values())
        self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                        desc=f"load {path.name}", disable=not progress)
        self.read = 0

    def get(self, name: str):
        array = super().get(name)
        self.read += 1
        self.bar.set_postfix_str(f"{self.read}/{self.num_tensors} tensors", refresh=False)
        self.bar.update(array.nbytes)
        return array
