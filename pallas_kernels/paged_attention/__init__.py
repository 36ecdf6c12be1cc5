"""Paged attention over a paged KV cache (FLOAT32 / BF16 / FP8 / NVFP4 pages).

``decode.paged_decode`` is the split-K Pallas decode kernel (Triton lowering) and
``reference.paged_decode_reference`` the plain-jnp reference; both take raw arrays, the
``KVDtype`` enum and the ``DecodeConfig`` of ``config``.
"""

from pallas_kernels._device import device_sm_count
from pallas_kernels.paged_attention.config import (
    DecodeConfig,
    KVDtype,
    choose_decode_config,
    kv_bytes_per_token,
)
from pallas_kernels.paged_attention.decode import combine_splits, paged_decode
from pallas_kernels.paged_attention.reference import dequantize_pages, paged_decode_reference

__all__ = [
    "DecodeConfig",
    "KVDtype",
    "choose_decode_config",
    "combine_splits",
    "dequantize_pages",
    "device_sm_count",
    "kv_bytes_per_token",
    "paged_decode",
    "paged_decode_reference",
]
