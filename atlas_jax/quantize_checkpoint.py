"""Quantize the expert weights of an HF directory: ``atlas-jax quantize SRC DST --format F``.

Writes the layouts the loaders of real checkpoints read, per linear ``P`` (``P.weight`` in SRC):

- ``nvfp4`` (NVIDIA ModelOpt): ``P.weight`` uint8 [N, K/2], ``P.weight_scale`` F8_E4M3 [N, K/16],
  ``P.weight_scale_2`` F32 scalar; ``quantization_config = {quant_method: modelopt,
  quant_algo: NVFP4, group_size: 16, exclude_modules: [...]}``. Weights only (W4A16): no
  activation ``input_scale`` is calibrated or written.
- ``fp8`` (DeepSeek-V3 fine-grained FP8): ``P.weight`` F8_E4M3 [N, K], ``P.weight_scale_inv`` F32
  [ceil(N/128), ceil(K/128)]; ``{quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
  weight_block_size: [128, 128], modules_to_not_convert: [...]}``.
- ``mxfp4`` (gpt-oss): fused experts ``experts.gate_up_proj_blocks`` U8 [E, N, K/32, 16] and
  ``experts.gate_up_proj_scales`` U8 [E, N, K/32] (gpt-oss's own layout); per-expert linears as
  ``P.weight_blocks`` / ``P.weight_scales`` [N, K/32, 16] / [N, K/32]; ``{quant_method: mxfp4,
  modules_to_not_convert: [...]}``.

Routed experts are always quantized, the shared expert(s) with ``shared=True``; everything else
(attention, routers, norms, embeddings, dense MLPs) is copied unchanged. Shards are kept: each
SRC file becomes one DST file, with the index rewritten.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from atlas_jax._safetensors import SafetensorsFile, save_file
from atlas_jax.checkpoint import Checkpoint
from atlas_jax.config import Format, MoEConfig
from atlas_jax.quant import QTensor, quantize

FORMATS = {"nvfp4": Format.NVFP4, "fp8": Format.FP8_BLOCK, "mxfp4": Format.MXFP4}

_EXPERT_LINEAR = re.compile(
    r"(?P<p>.*\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3))\.weight$")
_SHARED_LINEAR = re.compile(
    r"(?P<p>.*\.shared_experts?\.(gate_proj|up_proj|down_proj|w1|w2|w3))\.weight$")
# Fused expert stacks: gpt-oss stores them input-major [E, K, N], Gemma-4 output-major [E, N, K].
_FUSED = re.compile(r"(?P<p>.*\.experts\.(gate_up_proj|down_proj))$")
_INPUT_MAJOR_FUSED = {"gpt_oss"}


def _np(a) -> np.ndarray:
    return np.asarray(a)


def _linear_tensors(prefix: str, q: QTensor) -> dict[str, np.ndarray]:
    """Tensors of one quantized linear in its format's checkpoint layout."""
    match q.format:
        case Format.NVFP4:
            return {f"{prefix}.weight": _np(q.data), f"{prefix}.weight_scale": _np(q.scale),
                    f"{prefix}.weight_scale_2": _np(q.global_scale).reshape(())}
        case Format.FP8_BLOCK:
            return {f"{prefix}.weight": _np(q.data), f"{prefix}.weight_scale_inv": _np(q.scale)}
        case Format.MXFP4:
            *lead, n, half_k = q.data.shape
            blocks = _np(q.data).reshape(*lead, n, half_k // 16, 16)
            suffix = "" if _FUSED.match(prefix) else ".weight"  # gpt-oss: experts.down_proj_blocks
            return {f"{prefix}{suffix}_blocks": blocks, f"{prefix}{suffix}_scales": _np(q.scale)}
    raise AssertionError(q.format)


def _quantization_config(fmt: Format, excluded: list[str]) -> dict:
    match fmt:
        case Format.NVFP4:
            return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                    "exclude_modules": excluded}
        case Format.FP8_BLOCK:
            return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128], "modules_to_not_convert": excluded}
        case Format.MXFP4:
            return {"quant_method": "mxfp4", "modules_to_not_convert": excluded}
    raise AssertionError(fmt)


def _excluded_modules(names: list[str], quantized: set[str]) -> list[str]:
    """Linear modules (``*.weight`` of 2-D tensors in ``names``) left unquantized."""
    return sorted({n.removesuffix(".weight") for n in names
                   if n.endswith(".weight") and n.removesuffix(".weight") not in quantized})


def quantize_checkpoint(src, dst, fmt: str | Format, *, shared: bool = False,
                        progress: bool = True) -> Path:
    """Write ``dst``: ``src`` with its expert weights quantized to ``fmt``. Returns ``dst``."""
    fmt = FORMATS.get(fmt, fmt) if isinstance(fmt, str) else fmt
    if fmt not in FORMATS.values():
        raise ValueError(f"format {fmt!r}: expected one of {', '.join(FORMATS)}")
    ck = Checkpoint(src)
    if ck.config.get("quantization_config"):
        raise ValueError(f"{src}: already quantized "
                         f"({ck.config['quantization_config'].get('quant_method')})")
    model_type = ck.config.get("model_type")
    MoEConfig.from_hf_config(ck.config)  # supported architecture, or a clear error
    src, dst = Path(src), Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst}: exists and is not empty")
    dst.mkdir(parents=True, exist_ok=True)

    fused = [n for n in ck._where if _FUSED.match(n)]
    if fused and fmt is not Format.MXFP4:
        raise NotImplementedError(
            f"{src}: fused expert stacks ({model_type}, e.g. {fused[0]}) are written only as "
            f"MXFP4 (the gpt-oss layout); NVFP4 / FP8 exports of fused experts have no standard "
            f"layout")
    files = sorted(set(ck._where.values()))
    _check_blocks(files, fmt, shared, input_major=model_type in _INPUT_MAJOR_FUSED)
    total = sum(p.stat().st_size for p in files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"quantize {fmt.value}",
               disable=not progress)
    quantized: set[str] = set()
    linears: list[str] = []  # 2-D tensors: the candidates for exclude lists
    weight_map: dict[str, str] = {}
    for path in files:
        f = SafetensorsFile(path)
        out: dict[str, np.ndarray] = {}
        for name in f.names():
            tensor = f.get(name)
            if tensor.ndim == 2:
                linears.append(name)
            new = _quantize_tensor(name, tensor, fmt, model_type, shared)
            if new is None:
                out[name] = tensor
            else:
                quantized.add(name.removesuffix(".weight"))
                out.update(new)
            bar.update(tensor.nbytes)
        save_file(out, dst / path.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, path.name))
    bar.close()
    if not quantized:
        raise ValueError(f"{src}: no expert weights found to quantize")

    config = dict(ck.config)
    config["quantization_config"] = _quantization_config(
        fmt, _excluded_modules(linears, quantized))
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (src / "model.safetensors.index.json").is_file():
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / extra).is_file():
            shutil.copy(src / extra, dst / extra)
    return dst


def _quantized_name(name: str, shared: bool) -> bool:
    return bool(_FUSED.match(name) or _EXPERT_LINEAR.match(name)
                or (shared and _SHARED_LINEAR.match(name)))


def _check_blocks(files: list[Path], fmt: Format, shared: bool, input_major: bool) -> None:
    """Before writing anything: every weight to quantize has a K its format's block divides."""
    block = {Format.NVFP4: 16, Format.MXFP4: 32}.get(fmt)
    if block is None:
        return  # FP8 blocks may be partial at the edges
    for path in files:
        f = SafetensorsFile(path)
        for name in f.names():
            dtype, shape = f.info(name)
            if not dtype.startswith(("F", "BF")) or not _quantized_name(name, shared):
                continue
            k = shape[1] if input_major and _FUSED.match(name) else shape[-1]
            if k % block:
                raise ValueError(f"{name}: K={k} is not a multiple of the {fmt.value} block "
                                 f"{block}; it cannot be quantized to {fmt.value}")


def _quantize_tensor(name: str, tensor: np.ndarray, fmt: Format, model_type: str,
                     shared: bool) -> dict[str, np.ndarray] | None:
    """The quantized replacement tensors of ``name``, or None to copy it unchanged."""
    if not np.issubdtype(tensor.dtype, np.floating) and tensor.dtype.name != "bfloat16":
        return None
    if m := _FUSED.match(name):
        w = jnp.asarray(tensor)
        if model_type in _INPUT_MAJOR_FUSED:
            w = jnp.swapaxes(w, 1, 2)  # [E, K, N] -> [E, N, K]
        return _linear_tensors(m["p"], quantize(w.astype(jnp.float32), fmt))
    m = _EXPERT_LINEAR.match(name) or (shared and _SHARED_LINEAR.match(name))
    if not m:
        return None
    return _linear_tensors(m["p"], quantize(jnp.asarray(tensor, jnp.float32), fmt))
