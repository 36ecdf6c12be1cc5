"""Static configuration of paged-attention decode: the KV dtype enum, the decode config, and the
heuristic that picks it.

Everything here is hashable and validated at construction, so it can be a static argument of
``jax.jit``. Nothing here imports ``atlas_jax``: ``KVDtype.coerce`` accepts any enum member (or
string) with the same ``.value``, e.g. ``atlas_jax.KVDtype.BF16``.
"""

from __future__ import annotations

import dataclasses
import enum
import math

NVFP4_GROUP = 16  # E2M1 values along D that share one E4M3 scale
HEAD_DIMS = (64, 128, 256, 512)  # head dims the decode kernel tiles (D is held whole)
MIN_DOT = 16  # smallest tl.dot extent along M, N and K


class KVDtype(enum.Enum):
    """Storage dtype of the KV pages (values match ``atlas_jax.KVDtype``)."""

    FLOAT32 = "float32"  # pages [N, P, K, D] f32
    BF16 = "bf16"  # pages [N, P, K, D] bf16
    FP8 = "fp8"  # pages [N, P, K, D] e4m3fn, scale [N, P, K] f32 per token per head
    NVFP4 = "nvfp4"  # pages [N, P, K, D//2] u8 (low nibble = even d), scale [N, P, K, D//16]
    #                  e4m3fn per 16 along D, global [N, P, K] f32 per token per head

    @classmethod
    def coerce(cls, value) -> KVDtype:
        """The member for ``value``: a member, a str, or any enum with the same value."""
        if isinstance(value, cls):
            return value
        raw = value.value if isinstance(value, enum.Enum) else value
        try:
            return cls(raw)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"kv_dtype: expected one of {allowed}, got {value!r}") from None

    @property
    def bytes_per_element(self) -> float:
        """Bytes one K (or V) element costs in the cache, scales included."""
        match self:
            case KVDtype.FLOAT32:
                return 4.0
            case KVDtype.BF16:
                return 2.0
            case KVDtype.FP8:
                return 1.0  # + 4 bytes per token-head of scale (see kv_bytes_per_token)
            case KVDtype.NVFP4:
                return 0.5 + 1.0 / NVFP4_GROUP  # + 4 bytes per token-head of global scale


def kv_bytes_per_token(kv_dtype: KVDtype, num_kv_heads: int, head_dim: int) -> int:
    """HBM bytes of K plus V (data and scales) of one token over all kv heads."""
    kv_dtype = KVDtype.coerce(kv_dtype)
    per_head = kv_dtype.bytes_per_element * head_dim
    if kv_dtype in (KVDtype.FP8, KVDtype.NVFP4):
        per_head += 4  # the f32 per-token scale / global
    return int(2 * num_kv_heads * per_head)


def _is_pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


def _next_pow2(v: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(v, 1))))


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the split-K decode kernel.

    The grid is ``(batch, num_kv_heads, num_splits)``. Each program walks its share (1 /
    ``num_splits``) of one sequence's pages, ``pages_per_step`` pages (``pages_per_step *
    page_size`` tokens, a power of two >= 16) per loop step.
    """

    pages_per_step: int  # pages gathered per inner-loop step (power of two)
    num_splits: int = 1  # split-K partitions of each sequence (1: no reduce pass)
    num_warps: int = 4
    num_stages: int = 2  # software-pipelining depth of the page loop

    def __post_init__(self):
        if not _is_pow2(self.pages_per_step) or self.pages_per_step > 256:
            raise ValueError(
                f"DecodeConfig.pages_per_step: expected a power of two in [1, 256], "
                f"got {self.pages_per_step!r}"
            )
        if (
            not isinstance(self.num_splits, int)
            or isinstance(self.num_splits, bool)
            or not 1 <= self.num_splits <= 4096
        ):
            raise ValueError(
                f"DecodeConfig.num_splits: expected an int in [1, 4096], got {self.num_splits!r}"
            )
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"DecodeConfig.num_warps: expected one of 1, 2, 4, 8, 16, got {self.num_warps!r}"
            )
        if (
            not isinstance(self.num_stages, int)
            or isinstance(self.num_stages, bool)
            or not 1 <= self.num_stages <= 8
        ):
            raise ValueError(
                f"DecodeConfig.num_stages: expected an int in [1, 8], got {self.num_stages!r}"
            )

    def tokens_per_step(self, page_size: int) -> int:
        return self.pages_per_step * page_size

    def check(self, page_size: int) -> None:
        """Raises ValueError when this config cannot run with ``page_size``."""
        t = self.tokens_per_step(page_size)
        if t < MIN_DOT or t > 1024:
            raise ValueError(
                f"DecodeConfig.pages_per_step: pages_per_step * page_size = "
                f"{self.pages_per_step} * {page_size} = {t} tokens per step; the kernel needs "
                f"[{MIN_DOT}, 1024] (tl.dot extents)"
            )



def choose_decode_config(
    batch: int,
    num_kv_heads: int,
    q_per_kv: int,
    q_len: int,
    max_pages: int,
    page_size: int,
    head_dim: int,
    kv_dtype: KVDtype | str,
    sm_count: int | None,
) -> DecodeConfig:
    """Pure heuristic: a decode config from static shapes, the KV dtype and the SM count.

    * Tokens per step: the dequantized K and V tiles ``[T, D]`` live in registers (and, when
      pipelined, their raw bytes in shared memory), so ``T * D`` is held near 16K elements
      (8K for f32): T = 128 at D <= 128, 64 at D = 256, 32 at D = 512 -- 64 KB of bf16 K+V in
      flight per step, several pages each. Never fewer than 16 tokens (tl.dot), never many
      more pages than the block table has.
    * Splits: decode is bound by KV bytes, so the grid must cover the GPU. ``batch *
      num_kv_heads`` programs are split along the sequence until there are about two
      programs per SM, but each split keeps >= 2 loop steps of the table's capacity (shorter
      splits spend more on the reduce and on the pipeline prologue than they win). With
      ``sm_count=None`` (no GPU: interpret mode) there is one split.
    * Stages: as many steps in flight as ~160 KB of shared memory holds (2..4).
    """
    kv_dtype = KVDtype.coerce(kv_dtype)
    for name, v in (
        ("batch", batch),
        ("num_kv_heads", num_kv_heads),
        ("q_per_kv", q_per_kv),
        ("q_len", q_len),
        ("max_pages", max_pages),
        ("page_size", page_size),
        ("head_dim", head_dim),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"choose_decode_config: {name} must be a positive int, got {v!r}")
    if not _is_pow2(page_size):
        raise ValueError(f"choose_decode_config: page_size must be a power of two, got {page_size}")

    elems = 8192 if kv_dtype is KVDtype.FLOAT32 else 16384
    tokens = min(128, max(MIN_DOT, elems // head_dim))
    pages_per_step = max(1, tokens // page_size)
    pages_per_step = min(pages_per_step, _next_pow2(max_pages))
    pages_per_step = max(pages_per_step, _next_pow2(-(-MIN_DOT // page_size)))
    pages_per_step = min(pages_per_step, 256)

    num_splits = 1
    if sm_count is not None and sm_count > 0:
        programs = batch * num_kv_heads
        steps = -(-max_pages // pages_per_step)
        want = -(-2 * sm_count // programs)
        num_splits = max(1, min(want, steps // 2, 4096))

    # Pipelining depth: raw K+V bytes of one step in shared memory, within ~160 KB.
    rows = q_len * q_per_kv
    tile = pages_per_step * page_size * head_dim
    stage_bytes = 2 * tile * kv_dtype.bytes_per_element
    num_stages = int(max(2, min(4, (160 * 1024) // max(stage_bytes, 1))))
    # Warps: the f32 accumulator [R, D] and the q block stay in registers across the loop.
    num_warps = 8 if rows * head_dim >= 16384 or tile >= 32768 else 4
    return DecodeConfig(pages_per_step, num_splits, num_warps, num_stages)
