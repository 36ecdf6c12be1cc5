"""Paged attention over a paged KV cache (FLOAT32 / BF16 / FP8 / NVFP4 pages).

``decode.paged_decode`` is the split-K Pallas decode kernel and ``prefill.paged_prefill`` the
flash-attention prefill kernel (both on the Triton lowering); ``mosaic.paged_decode_mosaic`` the
FP8-KV decode kernel on Mosaic GPU (sm_90, e4m3 tensor-core dots on the cached bytes);
``reference.paged_decode_reference``
and ``reference.paged_prefill_reference`` are the plain-jnp references. All take raw arrays, the
``KVDtype`` enum and the ``DecodeConfig`` / ``PrefillConfig`` of ``config``.
"""

from pallas_kernels._device import device_sm_count
from pallas_kernels.paged_attention.config import (
    HEAD_DIMS,
    DecodeConfig,
    KVDtype,
    PrefillConfig,
    choose_decode_config,
    choose_prefill_config,
    kv_bytes_per_token,
)
from pallas_kernels.paged_attention.decode import combine_splits, paged_decode
from pallas_kernels.paged_attention.mosaic import paged_decode_mosaic
from pallas_kernels.paged_attention.prefill import paged_prefill
from pallas_kernels.paged_attention.reference import (
    dequantize_pages,
    paged_decode_reference,
    paged_prefill_reference,
)

__all__ = [
    "HEAD_DIMS",
    "DecodeConfig",
    "KVDtype",
    "PrefillConfig",
    "choose_decode_config",
    "choose_prefill_config",
    "combine_splits",
    "dequantize_pages",
    "device_sm_count",
    "kv_bytes_per_token",
    "paged_decode",
    "paged_decode_mosaic",
    "paged_decode_reference",
    "paged_prefill",
    "paged_prefill_reference",
]
