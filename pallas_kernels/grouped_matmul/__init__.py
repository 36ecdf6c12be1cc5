"""Grouped (ragged) matmul of MoE experts over BF16 / FP8-block / NVFP4 / MXFP4 weights.

``kernel.grouped_matmul`` is the Pallas (Triton lowering) implementation for every format,
``mosaic.grouped_matmul_mosaic`` a BF16 Mosaic GPU one for Hopper, and
``reference.grouped_matmul_reference`` the plain-jnp one; all take raw arrays and the enums and
``TileConfig`` of ``config``.
"""

from pallas_kernels._device import device_compute_capability, device_kind, device_sm_count
from pallas_kernels.grouped_matmul.config import (
    Activation,
    ActivationQuant,
    GateUpLayout,
    TileConfig,
    WeightFormat,
    choose_tile_config,
)
from pallas_kernels.grouped_matmul.kernel import grouped_matmul, make_tile_table, max_num_tiles
from pallas_kernels.grouped_matmul.mosaic import (
    MosaicTileConfig,
    choose_mosaic_tile_config,
    grouped_matmul_mosaic,
)
from pallas_kernels.grouped_matmul.mosaic import unsupported_reason as mosaic_unsupported_reason
from pallas_kernels.grouped_matmul.reference import (
    dequantize_weights,
    gated_activation,
    grouped_matmul_reference,
    quantize_activations_fp8,
)

__all__ = [
    "Activation",
    "ActivationQuant",
    "MosaicTileConfig",
    "GateUpLayout",
    "TileConfig",
    "WeightFormat",
    "choose_mosaic_tile_config",
    "choose_tile_config",
    "dequantize_weights",
    "device_compute_capability",
    "device_kind",
    "device_sm_count",
    "gated_activation",
    "grouped_matmul",
    "grouped_matmul_mosaic",
    "grouped_matmul_reference",
    "make_tile_table",
    "max_num_tiles",
    "mosaic_unsupported_reason",
    "quantize_activations_fp8",
]
