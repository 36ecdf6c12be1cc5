"""Linears as checkpoints store them: the one way to turn a stored linear into a QTensor.

A linear is named by its module prefix ``p`` (e.g. ``model.layers.3.self_attn.q_proj``); its
format is told apart by the tensors present under it, per linear (quantization configs exclude
modules, so one layer may mix formats):

* MXFP4 (gpt-oss): ``p.weight_blocks`` uint8 ``[N, K/32, 16]`` + ``p.weight_scales``;
* NVFP4, compressed-tensors: ``p.weight_packed`` + ``p.weight_scale`` + ``p.weight_global_scale``;
* FP8 block (DeepSeek-V3): E4M3 ``p.weight`` + ``p.weight_scale_inv``;
* NVFP4, ModelOpt: uint8 ``p.weight`` + ``p.weight_scale`` + ``p.weight_scale_2``;
* otherwise floating-point ``p.weight`` (Format.BF16, kept in its stored dtype).

``stored_arrays`` + ``qtensor_from_arrays`` split the read from the construction, so a caller
can stack the arrays of several linears (experts) before building one ``[E, N, K]`` QTensor.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from atlas_jax.config import Format
from atlas_jax.quant.qtensor import QTensor

__all__ = ["linear_from_tensors", "qtensor_from_arrays", "stored_arrays"]

Get = Callable[[str], np.ndarray]  # tensor name -> array (numpy / ml_dtypes)
Has = Callable[[str], bool]  # tensor name -> whether it is stored


def stored_arrays(get: Get, has: Has, prefix: str) -> tuple[Format, dict[str, np.ndarray]]:
    """The stored tensors of linear ``prefix`` (keys without the prefix, e.g. ``"weight"``) and
    their format. Raises NotImplementedError for an FP8 weight without ``weight_scale_inv``
    (per-tensor FP8 is not a supported format)."""
    p = prefix
    if has(f"{p}.weight_blocks"):
        return Format.MXFP4, {"weight_blocks": get(f"{p}.weight_blocks"),
                              "weight_scales": get(f"{p}.weight_scales")}
    if has(f"{p}.weight_packed"):
        names = ("weight_packed", "weight_scale", "weight_global_scale")
        return Format.NVFP4, {n: get(f"{p}.{n}") for n in names}
    weight = get(f"{p}.weight")
    if has(f"{p}.weight_scale_inv"):  # E4M3 (or its uint8 bits)
        return Format.FP8_BLOCK, {"weight": weight,
                                  "weight_scale_inv": get(f"{p}.weight_scale_inv")}
    if weight.dtype == np.uint8:
        names = ("weight_scale", "weight_scale_2")
        return Format.NVFP4, {"weight": weight} | {n: get(f"{p}.{n}") for n in names}
    if weight.dtype.name.startswith("float8"):
        raise NotImplementedError(
            f"{p}.weight is {weight.dtype} without {p}.weight_scale_inv: only block-scaled FP8 "
            "(weight + weight_scale_inv) is supported")
    return Format.BF16, {"weight": weight}


def qtensor_from_arrays(fmt: Format, arrays: dict[str, np.ndarray],
                        fp8_block: tuple[int, int] = (128, 128)) -> QTensor:
    """The QTensor of ``stored_arrays``' result (arrays may carry leading dims, e.g. stacked
    experts). ``fp8_block``: the FP8 weight block (quantization_config's weight_block_size)."""
    a = arrays
    match fmt:
        case Format.MXFP4:
            return QTensor.from_mxfp4(a["weight_blocks"], a["weight_scales"])
        case Format.NVFP4 if "weight_packed" in a:
            return QTensor.from_nvfp4_compressed_tensors(
                a["weight_packed"], a["weight_scale"], a["weight_global_scale"])
        case Format.NVFP4:
            return QTensor.from_nvfp4_modelopt(a["weight"], a["weight_scale"], a["weight_scale_2"])
        case Format.FP8_BLOCK:
            return QTensor.from_fp8_block(a["weight"], a["weight_scale_inv"], fp8_block)
        case Format.BF16:
            return QTensor.from_float(jnp.asarray(a["weight"]), dtype=None)
    raise ValueError(f"fmt: expected a Format, got {fmt!r}")


def linear_from_tensors(get: Get, has: Has, prefix: str,
                        fp8_block: tuple[int, int] = (128, 128)) -> QTensor:
    """Linear ``prefix`` (module name, no trailing dot) as a ``[N, K]`` QTensor in the format
    it is stored in."""
    fmt, arrays = stored_arrays(get, has, prefix)
    return qtensor_from_arrays(fmt, arrays, fp8_block)
