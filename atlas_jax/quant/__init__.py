"""Quantized weight formats: BF16, FP8 block-scaled, NVFP4 and MXFP4.

``QTensor`` holds a ``[*L, N, K]`` weight (``[out, in]``, optional leading expert dims),
quantized along K; ``quantize`` / ``dequantize`` convert from and to dense arrays. The format
modules ``fp8``, ``nvfp4`` and ``mxfp4`` hold the plain-jnp reference math the kernels follow.
"""

from atlas_jax.config import Format
from atlas_jax.quant import fp8, mxfp4, nvfp4
from atlas_jax.quant.qtensor import QTensor, concat_rows, dequantize, quantize, reblock_rows

__all__ = [
    "Format",
    "QTensor",
    "concat_rows",
    "dequantize",
    "fp8",
    "mxfp4",
    "nvfp4",
    "quantize",
    "reblock_rows",
]
