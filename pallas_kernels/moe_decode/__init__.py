"""MoE decode: the routed experts of a few tokens (1..64 x top-k), expert-major, over BF16 /
FP8-block / NVFP4 / MXFP4 weights.

``kernel.moe_decode`` (combined ``[T, H]``) and ``kernel.moe_decode_pairs`` (per pair
``[T, k, H]``) are the Pallas (Triton lowering) implementation (``ExtraExperts``: a second
stack, the shared expert, read by the same launches); ``mosaic.moe_decode_mosaic_pairs`` the
Mosaic GPU one for Hopper (every format; weights as the wgmma's register operand); ``reference``
holds the plain-jnp ones.
Weight formats, activations and gate/up layouts are the grouped matmul's enums.
"""

from pallas_kernels.moe_decode.config import (
    DecodeTile,
    MoEDecodeConfig,
    choose_decode_config,
    choose_tile,
    expected_distinct_experts,
)
from pallas_kernels.moe_decode.kernel import (
    DecodePlan,
    ExtraExperts,
    combine,
    make_plan,
    moe_decode,
    moe_decode_pairs,
    pairs_of,
)
from pallas_kernels.moe_decode.mosaic import moe_decode_mosaic_pairs
from pallas_kernels.moe_decode.reference import (
    combine_reference,
    moe_decode_pairs_reference,
    moe_decode_reference,
)

__all__ = [
    "DecodePlan",
    "DecodeTile",
    "ExtraExperts",
    "MoEDecodeConfig",
    "choose_decode_config",
    "choose_tile",
    "combine",
    "combine_reference",
    "expected_distinct_experts",
    "make_plan",
    "moe_decode",
    "moe_decode_mosaic_pairs",
    "moe_decode_pairs",
    "moe_decode_pairs_reference",
    "moe_decode_reference",
    "pairs_of",
]
