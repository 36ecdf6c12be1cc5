"""Static configuration of paged attention: the KV dtype enum, the decode and prefill configs,
and the heuristics that pick them.

Everything here is hashable and validated at construction, so it can be a static argument of
``jax.jit``. Nothing here imports ``atlas_jax``: ``KVDtype.coerce`` accepts any enum member (or
string) with the same ``.value``, e.g. ``atlas_jax.KVDtype.BF16``.
"""

from __future__ import annotations

import dataclasses
import math

from pallas_kernels._enums import CoercibleEnum

NVFP4_GROUP = 16  # E2M1 values along D that share one E4M3 scale
HEAD_DIMS = (64, 128, 256, 512)  # head dims the decode kernel tiles (D is held whole)
MIN_DOT = 16  # smallest tl.dot extent along M, N and K
FP8_CONVERTS = ("cast", "asm")  # DecodeConfig.v_convert / k_convert


class KVDtype(CoercibleEnum):
    """Storage dtype of the KV pages (values match ``atlas_jax.KVDtype``)."""

    FLOAT32 = "float32"  # pages [N, P, K, D] f32
    BF16 = "bf16"  # pages [N, P, K, D] bf16
    FP8 = "fp8"  # pages [N, P, K, D] e4m3fn, scale [N, P, K] f32 per token per head
    NVFP4 = "nvfp4"  # pages [N, P, K, D//2] u8 (low nibble = even d), scale [N, P, K, D//16]
    #                  e4m3fn per 16 along D, global [N, P, K] f32 per token per head

    @classmethod
    def _arg(cls) -> str:
        return "kv_dtype"

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


def _prev_pow2(v: int) -> int:
    return 1 << max(0, int(v).bit_length() - 1)


def _check_shape_args(fn: str, **values) -> None:
    """The heuristics' argument checks: positive ints, and a power-of-two ``page_size``."""
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{fn}: {name} must be a positive int, got {v!r}")
    if not _is_pow2(values["page_size"]):
        raise ValueError(f"{fn}: page_size must be a power of two, got {values['page_size']}")


def _pages_per_step(tokens: int, page_size: int, max_pages: int) -> int:
    """Pages a step for about ``tokens`` tokens: at least 16 tokens (tl.dot), no more pages
    than the (pow2) block table has, at most 256."""
    pages_per_step = max(1, tokens // page_size)
    pages_per_step = min(pages_per_step, _next_pow2(max_pages))
    pages_per_step = max(pages_per_step, _next_pow2(-(-MIN_DOT // page_size)))
    return min(pages_per_step, 256)


# Programs of the heuristic's tiles an sm_90 SM holds at once, by registers (Nsight Compute on
# the H200, B32 16k, 4 warps, 128 tokens x D 128 a step): FP8 pages 255 registers a thread ->
# 2; BF16 156 -> 3 (the default, also taken for the other dtypes). A grid of 1.45 waves (FP8
# at 3 splits, B32 32/4 16k) ran 272 us of GPU time against 216 us at 2 splits (0.97 wave).
RESIDENT_PROGRAMS = {KVDtype.FP8: 2}


# A wave this full ties to fewer splits in ``wave_splits(fewer_when_full=True)``. The Mosaic FP8
# kernel, 1 against 2 splits (H100 SXM, NOTES session 39): at a fill of 0.97 (256 programs)
# 1 split 1-22% faster, at 0.73 / 0.61 (192 / 160) 15% / 27% slower. The Triton FP8 kernel
# keeps more splits at 0.97 (2 splits 2-5% faster there).
FULL_WAVE = 0.9


def _wave_efficiency(programs: int, slots: int) -> float:
    """Busy fraction of the resident-program slots over the waves ``programs`` take."""
    return programs / (slots * -(-programs // slots))


def wave_splits(programs: int, sm_count: int, resident: int, most: int,
                fewer_when_full: bool = False) -> int:
    """Splits of each of ``programs`` programs (a sequence's kv head): up to about two programs
    per SM and at most ``most``, the count whose last wave of ``resident`` programs per SM is
    fullest (``_wave_efficiency``). Ties go to more splits (every SM busy from the start),
    except with ``fewer_when_full`` where the tied waves are at least ``FULL_WAVE`` full: then
    more splits only add prologues and combine work (the Mosaic FP8 kernel, NOTES session 39)."""
    top = max(1, min(-(-2 * sm_count // programs), most, 4096))
    slots = resident * sm_count  # programs resident at once

    def key(s: int) -> tuple[float, int]:
        fill = _wave_efficiency(programs * s, slots)
        return fill, -s if fewer_when_full and fill >= FULL_WAVE else s

    return max(range(1, top + 1), key=key)


def _num_stages(tile: int, kv_dtype: KVDtype, budget_kb: int, most: int) -> int:
    """Pipelining depth: steps of raw K+V bytes (``tile`` elements each) within ``budget_kb``
    of shared memory, 2..``most``."""
    stage_bytes = 2 * tile * kv_dtype.bytes_per_element
    return int(max(2, min(most, (budget_kb * 1024) // max(stage_bytes, 1))))


class _LaunchConfig:
    """What ``DecodeConfig`` and ``PrefillConfig`` share (fields ``pages_per_step``,
    ``num_warps``, ``num_stages`` of the dataclasses deriving from this)."""

    def _check_warps_stages(self) -> None:
        cls = type(self).__name__
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"{cls}.num_warps: expected one of 1, 2, 4, 8, 16, got {self.num_warps!r}"
            )
        s = self.num_stages
        if not isinstance(s, int) or isinstance(s, bool) or not 1 <= s <= 8:
            raise ValueError(f"{cls}.num_stages: expected an int in [1, 8], got {s!r}")

    def tokens_per_step(self, page_size: int) -> int:
        return self.pages_per_step * page_size

    def _check_tokens_per_step(self, page_size: int) -> None:
        t = self.tokens_per_step(page_size)
        if t < MIN_DOT or t > 1024:
            raise ValueError(
                f"{type(self).__name__}.pages_per_step: pages_per_step * page_size = "
                f"{self.pages_per_step} * {page_size} = {t} tokens per step; the kernel needs "
                f"[{MIN_DOT}, 1024] (tl.dot extents)"
            )


@dataclasses.dataclass(frozen=True)
class DecodeConfig(_LaunchConfig):
    """Launch shape of the split-K decode kernel.

    The grid is ``(batch, num_kv_heads, num_splits)``. Each program walks its share (1 /
    ``num_splits``) of one sequence's pages, ``pages_per_step`` pages (``pages_per_step *
    page_size`` tokens, a power of two >= 16) per loop step.
    """

    pages_per_step: int  # pages gathered per inner-loop step (power of two)
    num_splits: int = 1  # split-K partitions of each sequence (1: no reduce pass)
    num_warps: int = 4
    num_stages: int = 2  # software-pipelining depth of the page loop
    # FP8 pages only (other dtypes need "cast"): how the e4m3 V (K) tile becomes the f16 dot
    # operand. "cast": Triton's own conversion, which it sinks past the change to the MMA
    # operand layout (V then reaches that layout as bytes, read one at a time: no 8-bit
    # ldmatrix.trans on sm_90). "asm": inline PTX ``cvt.rn.f16x2.e4m3x2`` right after the load
    # (``_dequant.fp8_to_f16``), so the layout change moves 16-bit data. An experiment: it
    # measured slower on the H200 in 24 of 34 FP8 decode-grid cases (B 32 16k 356 vs 316 us).
    v_convert: str = "cast"
    k_convert: str = "cast"

    def __post_init__(self):
        for name in ("v_convert", "k_convert"):
            if getattr(self, name) not in FP8_CONVERTS:
                raise ValueError(
                    f"DecodeConfig.{name}: expected one of {FP8_CONVERTS}, "
                    f"got {getattr(self, name)!r}"
                )
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
        self._check_warps_stages()

    def check(self, page_size: int, kv_dtype: KVDtype | str | None = None) -> None:
        """Raises ValueError when this config cannot run with ``page_size`` (and ``kv_dtype``,
        when given: ``v_convert`` / ``k_convert`` other than "cast" need FP8 pages)."""
        self._check_tokens_per_step(page_size)
        if kv_dtype is not None and KVDtype.coerce(kv_dtype) is not KVDtype.FP8:
            for name in ("v_convert", "k_convert"):
                if getattr(self, name) != "cast":
                    raise ValueError(
                        f"DecodeConfig.{name}={getattr(self, name)!r} applies to FP8 pages only, "
                        f"got kv_dtype {KVDtype.coerce(kv_dtype).value}"
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
      num_kv_heads`` programs are split along the sequence up to about two programs per SM,
      at the split count whose last wave of resident programs is fullest
      (``RESIDENT_PROGRAMS`` per SM: 2 for FP8 pages, 3 for the others;
      ``wave_splits``, ties to more splits), but each split keeps >= 2 loop steps of the
      table's capacity (shorter splits spend more on the reduce and on the pipeline prologue
      than they win). With ``sm_count=None`` (no GPU: interpret mode) there is one split. On
      the H200 that gives FP8 2 splits at B32 (1.45 -> 0.97 waves, 21% less GPU time) and
      leaves the other dtypes where they were: up to one wave of 3 per SM (99 splits at B=1
      32k, 49 at B=1 16k 64/8) measured no faster or 8% slower there.
    * Stages: as many steps in flight as ~160 KB of shared memory holds (2..4; FP8 2).
    * Warps: 8 for large register tiles, else 4.
    """
    kv_dtype = KVDtype.coerce(kv_dtype)
    _check_shape_args(
        "choose_decode_config",
        batch=batch,
        num_kv_heads=num_kv_heads,
        q_per_kv=q_per_kv,
        q_len=q_len,
        max_pages=max_pages,
        page_size=page_size,
        head_dim=head_dim,
    )

    elems = 8192 if kv_dtype is KVDtype.FLOAT32 else 16384
    tokens = min(128, max(MIN_DOT, elems // head_dim))
    pages_per_step = _pages_per_step(tokens, page_size, max_pages)

    num_splits = 1
    if sm_count is not None and sm_count > 0:
        steps = -(-max_pages // pages_per_step)
        num_splits = wave_splits(batch * num_kv_heads, sm_count,
                                 RESIDENT_PROGRAMS.get(kv_dtype, 3), steps // 2)

    # Pipelining depth: raw K+V bytes of one step in shared memory, within ~160 KB (FP8: 2,
    # measured faster than 3-4 on the H200, B32 4k-16k and B1 32k).
    rows = q_len * q_per_kv
    tile = pages_per_step * page_size * head_dim
    num_stages = _num_stages(tile, kv_dtype, 160, 2 if kv_dtype is KVDtype.FP8 else 4)
    # Warps: the f32 accumulator [R, D] and the q block stay in registers across the loop.
    # (8 warps for FP8 / NVFP4 pages, to hide their convert chains, measured slower on the
    # H200: FP8 B32 16k 292 -> 380 us, 4k 95 -> 112 us; benchmarks/NOTES.md.)
    num_warps = 8 if rows * head_dim >= 16384 or tile >= 32768 else 4
    return DecodeConfig(pages_per_step, num_splits, num_warps, num_stages)


MAX_PREFILL_ROWS = 256  # block_q * heads a program packs, padded to a power of two


@dataclasses.dataclass(frozen=True)
class PrefillConfig(_LaunchConfig):
    """Launch shape of the prefill kernel.

    The grid is ``(num_kv_heads * G / q_heads_per_program, ceil(S / block_q), batch)``. One
    program takes ``block_q`` consecutive queries of one sequence and ``q_heads_per_program``
    query heads of one kv head (``None``: all ``G`` of them, GQA packing) -- a query block of
    ``block_q * heads`` rows -- and walks the sequence's pages ``pages_per_step`` at a time
    (``pages_per_step * page_size`` tokens a step, a power of two >= 16).
    """

    block_q: int  # queries (tokens) of one program (power of two)
    pages_per_step: int  # pages gathered per inner-loop step (power of two)
    q_heads_per_program: int | None = None  # None: all G query heads of the kv head
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name, top in (("block_q", 256), ("pages_per_step", 256)):
            v = getattr(self, name)
            if not _is_pow2(v) or v > top:
                raise ValueError(
                    f"PrefillConfig.{name}: expected a power of two in [1, {top}], got {v!r}"
                )
        h = self.q_heads_per_program
        if h is not None and (not isinstance(h, int) or isinstance(h, bool) or h <= 0):
            raise ValueError(
                f"PrefillConfig.q_heads_per_program: expected a positive int or None, got {h!r}"
            )
        self._check_warps_stages()

    def heads(self, q_per_kv: int) -> int:
        """Query heads one program packs."""
        return q_per_kv if self.q_heads_per_program is None else self.q_heads_per_program

    def rows(self, q_per_kv: int) -> int:
        """Rows of a program's query block: block_q * heads, padded to a power of two >= 16."""
        return max(MIN_DOT, _next_pow2(self.block_q * self.heads(q_per_kv)))

    def check(self, page_size: int, q_per_kv: int) -> None:
        """Raises ValueError when this config cannot run with ``page_size`` and ``G``."""
        self._check_tokens_per_step(page_size)
        h = self.heads(q_per_kv)
        if q_per_kv % h:
            raise ValueError(
                f"PrefillConfig.q_heads_per_program: expected a divisor of the {q_per_kv} query "
                f"heads per kv head, got {h}"
            )
        if self.rows(q_per_kv) > MAX_PREFILL_ROWS:
            raise ValueError(
                f"PrefillConfig.block_q: block_q * heads = {self.block_q} * {h} rows exceed "
                f"{MAX_PREFILL_ROWS}"
            )


def choose_prefill_config(
    batch: int,
    num_kv_heads: int,
    q_per_kv: int,
    q_len: int,
    max_pages: int,
    page_size: int,
    head_dim: int,
    kv_dtype: KVDtype | str,
    sm_count: int | None,
) -> PrefillConfig:
    """Pure heuristic: a prefill config from static shapes, the KV dtype and the SM count.

    * Rows: prefill is bound by the two dots per step, so the query block is made as tall as
      the f32 accumulator ``[R, D]`` allows in registers: R = 128 at D <= 128, 64 at D = 256,
      32 at D = 512, packing all G heads of the kv head (each K/V tile then feeds
      ``block_q * G`` rows). When G alone exceeds that, a program takes the largest divisor of
      G that fits and ``block_q = 1``. ``block_q`` never exceeds the chunk's (pow2) length.
    * Grid: when ``batch * num_kv_heads * tiles`` falls short of two programs per SM (short
      chunks), ``block_q`` halves (down to 16 rows) so more SMs have work.
    * Tokens per step: 64 at D <= 128 (f32 pages: 32), 32 at D = 256, 16 at D = 512 -- the
      dequantized K and V tiles ``[T, D]`` and the logits ``[R, T]`` live in registers --
      never fewer than 16 nor many more pages than the block table has.
    * Warps 8 once ``R * D >= 16K`` accumulator elements, else 4; stages as many as ~96 KB of
      raw K+V bytes hold (2..3).
    """
    kv_dtype = KVDtype.coerce(kv_dtype)
    _check_shape_args(
        "choose_prefill_config",
        batch=batch,
        num_kv_heads=num_kv_heads,
        q_per_kv=q_per_kv,
        q_len=q_len,
        max_pages=max_pages,
        page_size=page_size,
        head_dim=head_dim,
    )

    target = max(MIN_DOT, min(128, 16384 // head_dim))  # rows
    if q_per_kv <= target:
        heads = None
        block_q = max(1, _prev_pow2(target // q_per_kv))
    else:  # more query heads per kv head than rows: split the group
        heads = max(h for h in range(1, target + 1) if q_per_kv % h == 0)
        block_q = 1
    block_q = min(block_q, _next_pow2(q_len))
    packed = q_per_kv if heads is None else heads
    if sm_count:
        while block_q > 1 and block_q * packed > MIN_DOT:
            programs = batch * num_kv_heads * (q_per_kv // packed) * -(-q_len // block_q)
            if programs >= 2 * sm_count:
                break
            block_q //= 2

    tokens = 64 if head_dim <= 128 else 8192 // head_dim
    if kv_dtype is KVDtype.FLOAT32:
        tokens = max(MIN_DOT, tokens // 2)
    pages_per_step = _pages_per_step(tokens, page_size, max_pages)

    cfg = PrefillConfig(block_q, pages_per_step, heads)
    rows = cfg.rows(q_per_kv)
    tile = pages_per_step * page_size * head_dim
    num_stages = _num_stages(tile, kv_dtype, 96, 3)
    num_warps = 8 if rows * head_dim >= 16384 else 4
    return dataclasses.replace(cfg, num_warps=num_warps, num_stages=num_stages)
