"""The paged KV cache: K and V pages, their scales, slot mapping, scatter writes and gathers.

Layout (one cache per attention layer; N pages of P tokens, K kv heads, head_dim D)::

    k.data, v.data   FLOAT32 / BF16: [N, P, K, D] f32 / bf16
                     FP8:            [N, P, K, D] float8_e4m3fn
                     NVFP4:          [N, P, K, D//2] uint8, two E2M1 codes a byte, low nibble =
                                     even d (the packing of atlas_jax.quant)
    k.scale, ...     FP8:   [N, P, K] f32, one scale per token per head
                     NVFP4: [N, P, K, D//16] float8_e4m3fn, one scale per 16 along D
    k.global_scale   NVFP4: [N, P, K] f32, one global per token per head

A token at logical position ``t`` of sequence ``b`` lives in slot
``block_tables[b, t // P] * P + t % P`` of the flattened ``[N * P, ...]`` arrays.

Why per token (and per head), not per page: tokens arrive one write at a time, and a page is
shared by tokens written in different steps. A per-page scale would have to be fixed before the
page fills (saturating later, larger tokens) or grow, re-quantizing the tokens already there.
A per-token scale is written once with its token and never touches a neighbour, so a write only
ever changes its own slots, chunked prefill stores bit for bit what one-shot prefill stores, and
the error of each token is bounded by its own amax. The cost is 4 bytes per token per head
(3 % of an FP8 page at D = 128; a kernel reads them with the page).

FP8 values: ``e4m3(clip(x / s, -448, 448))``, dequantized ``f32(q) * s``:

* ``fp8_kv_calibration_tokens == 0``: ``s = amax(|x_token_head|) / 448`` (1 for an all-zero
  vector): per-element relative error <= 2^-4 (3 mantissa bits, round to nearest) plus E4M3's
  subnormal floor 2^-9 * s.
* ``fp8_kv_calibration_tokens == n > 0``: the engine's online calibration. The cache carries a
  running per-head amax of K and V (``fp8_amax [2, K]``) over the first ``n`` tokens written to
  it (counted in write order, ``fp8_seen``), and every token of a write is stored with
  ``s = amax / 448`` of the amax after that write's calibration tokens. After ``n`` tokens the
  scale is frozen: later, larger values saturate at +-448 * s, exactly the engine's static scale.
  The scale is still stored per token, so both modes share one read path.

NVFP4 values: each token-head vector is quantized as one NVFP4 row of ``atlas_jax.quant.nvfp4``:
``g = amax / (6 * 448)``, E4M3 block scale ``s_j ~ amax_j / (6 g)`` per 16 elements, E2M1
values; dequantized ``e2m1 * f32(s_j) * g``. The per-token global keeps small-magnitude heads
out of E4M3's subnormal range.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from atlas_jax.config import AttentionConfig, KVDtype
from atlas_jax.quant import nvfp4
from atlas_jax.quant.fp8 import E4M3_MAX, div_rn, to_e4m3

_STORAGE = {KVDtype.FLOAT32: jnp.float32, KVDtype.BF16: jnp.bfloat16,
            KVDtype.FP8: jnp.float8_e4m3fn, KVDtype.NVFP4: jnp.uint8}


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["data", "scale", "global_scale"], meta_fields=["dtype"])
@dataclasses.dataclass(frozen=True)
class KVPages:
    """K or V storage with leading dims ``[*L]`` (``[N, P]`` pages, or ``[T]`` new tokens)."""

    data: jax.Array  # [*L, K, D] f32/bf16/e4m3, or [*L, K, D//2] uint8 (NVFP4)
    scale: jax.Array | None  # FP8: [*L, K] f32 | NVFP4: [*L, K, D//16] e4m3 | else None
    global_scale: jax.Array | None  # NVFP4: [*L, K] f32 | else None
    dtype: KVDtype

    @property
    def head_dim(self) -> int:
        d = self.data.shape[-1]
        return 2 * d if self.dtype is KVDtype.NVFP4 else d

    def dequantize(self) -> jax.Array:
        """``[*L, K, D]`` float32."""
        match self.dtype:
            case KVDtype.FLOAT32 | KVDtype.BF16:
                return self.data.astype(jnp.float32)
            case KVDtype.FP8:
                return self.data.astype(jnp.float32) * self.scale[..., None]
            case KVDtype.NVFP4:  # one NVFP4 row per token-head, as quantize_tokens wrote it
                return nvfp4.dequantize(self.data[..., None, :], self.scale[..., None, :],
                                        self.global_scale[..., None])[..., 0, :]

    def map(self, f: Callable[[jax.Array], jax.Array]) -> KVPages:
        """Apply ``f`` to every array (they share the leading dims)."""
        return jax.tree.map(f, self)


def quantize_tokens(x: jax.Array, dtype: KVDtype, fp8_scale: jax.Array | None = None) -> KVPages:
    """``x [T, K, D]`` float -> KVPages with leading dims ``[T]``.

    ``fp8_scale [T, K]`` overrides FP8's per-token amax/448 scale (calibrated caches).
    """
    x = x.astype(jnp.float32)
    match dtype:
        case KVDtype.FLOAT32 | KVDtype.BF16:
            return KVPages(x.astype(_STORAGE[dtype]), None, None, dtype)
        case KVDtype.FP8:
            s = fp8_scale if fp8_scale is not None else amax_scale(jnp.max(jnp.abs(x), -1))
            return KVPages(to_e4m3(div_rn(x, s[..., None])), s, None, dtype)  # [T, K, D], [T, K]
        case KVDtype.NVFP4:
            data, scale, g = nvfp4.quantize(x[..., None, :])  # one NVFP4 row per token-head
            return KVPages(data[..., 0, :], scale[..., 0, :], g[..., 0], dtype)


def zero_pages(lead: tuple[int, ...], head_dim: int, dtype: KVDtype) -> KVPages:
    """All-zero storage with leading dims ``lead`` (scales 1, as quantizing zeros gives)."""
    zeros = functools.partial(jnp.zeros, dtype=_STORAGE[dtype])
    match dtype:
        case KVDtype.FLOAT32 | KVDtype.BF16:
            return KVPages(zeros((*lead, head_dim)), None, None, dtype)
        case KVDtype.FP8:
            return KVPages(zeros((*lead, head_dim)), jnp.ones(lead, jnp.float32), None, dtype)
        case KVDtype.NVFP4:
            scale = jnp.ones((*lead, head_dim // nvfp4.BLOCK), jnp.float8_e4m3fn)
            return KVPages(zeros((*lead, head_dim // 2)), scale, jnp.zeros(lead, jnp.float32),
                           dtype)


def amax_scale(amax: jax.Array) -> jax.Array:
    """FP8 scale ``amax / 448``; 1 where amax is 0 (an all-zero vector)."""
    s = div_rn(amax.astype(jnp.float32), E4M3_MAX)
    return jnp.where(s == 0, 1.0, s)


# ---- slot mapping -------------------------------------------------------------------------------


def slot_mapping(block_tables: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Flat cache slot of each token: ``[B, Pt]``, ``[B, S]`` -> ``[B, S]`` int32.

    ``slot = block_tables[b, t // page_size] * page_size + t % page_size``. A negative position
    (padding) or one past the table's capacity ``Pt * page_size`` maps to -1, which
    :meth:`PagedKVCache.write` drops; the layer rejects out-of-capacity positions before that.
    """
    num_table_pages = block_tables.shape[1]
    page = positions // page_size  # [B, S]
    valid = (positions >= 0) & (page < num_table_pages)
    phys = jnp.take_along_axis(block_tables, jnp.clip(page, 0, num_table_pages - 1), axis=1)
    return jnp.where(valid, phys * page_size + positions % page_size, -1).astype(jnp.int32)


# ---- the cache ----------------------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["k", "v", "fp8_amax", "fp8_seen"],
                   meta_fields=["dtype", "calibration_tokens"])
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """One layer's paged K/V cache (layout in the module docstring). Functional: ``write``
    returns a new cache."""

    k: KVPages  # pages [N, P, K, ...]
    v: KVPages  # pages [N, P, K, ...]
    fp8_amax: jax.Array | None  # [2, K] f32 running amax of K, V (calibrated FP8 only)
    fp8_seen: jax.Array | None  # [] int32 tokens counted towards calibration (calibrated FP8)
    dtype: KVDtype
    calibration_tokens: int  # AttentionConfig.fp8_kv_calibration_tokens (FP8; else 0)

    @classmethod
    def create(cls, num_pages: int, page_size: int, cfg: AttentionConfig,
               dtype: KVDtype = KVDtype.BF16) -> PagedKVCache:
        """An all-zero cache of ``num_pages`` pages of ``page_size`` tokens for ``cfg``."""
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"PagedKVCache.create: {name} must be a positive int, "
                                 f"got {value!r}")
        if not isinstance(cfg, AttentionConfig):
            raise TypeError(f"PagedKVCache.create: cfg must be an AttentionConfig, "
                            f"got {type(cfg).__name__}")
        try:
            dtype = KVDtype(dtype)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in KVDtype)
            raise ValueError(f"PagedKVCache.create: dtype must be one of {allowed}, "
                             f"got {dtype!r}") from None
        d, kh = cfg.head_dim, cfg.num_kv_heads
        if dtype is KVDtype.NVFP4 and d % nvfp4.BLOCK:
            raise ValueError(f"PagedKVCache.create: NVFP4 KV needs head_dim a multiple of "
                             f"{nvfp4.BLOCK}, got {d}")
        calib = cfg.fp8_kv_calibration_tokens if dtype is KVDtype.FP8 else 0
        return cls(  # K and V in buffers of their own: a jitted step may donate the cache
            k=zero_pages((num_pages, page_size, kh), d, dtype),
            v=zero_pages((num_pages, page_size, kh), d, dtype),
            fp8_amax=jnp.zeros((2, kh), jnp.float32) if calib else None,
            fp8_seen=jnp.zeros((), jnp.int32) if calib else None,
            dtype=dtype,
            calibration_tokens=calib,
        )

    @property
    def num_pages(self) -> int:
        return self.k.data.shape[0]

    @property
    def page_size(self) -> int:
        return self.k.data.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.data.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.head_dim

    @property
    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))

    def slot_mapping(self, block_tables: jax.Array, positions: jax.Array) -> jax.Array:
        """:func:`slot_mapping` with this cache's page size."""
        return slot_mapping(block_tables, positions, self.page_size)

    def write(self, slots: jax.Array, k: jax.Array, v: jax.Array) -> PagedKVCache:
        """Scatter new tokens into their slots: ``slots [T]`` int (-1: skip), ``k, v [T, K, D]``.

        Only the given slots change (every array is indexed by slot), so with block tables that
        give each sequence its own pages a write never touches another sequence. Duplicate slots
        within one write are an error the layer checks for (their order would be undefined).
        """
        t = slots.shape[0] if slots.ndim == 1 else -1
        want = (t, self.num_kv_heads, self.head_dim)
        if slots.ndim != 1 or k.shape != want or v.shape != want:
            raise ValueError(f"PagedKVCache.write: expected slots [T] and k, v [T, "
                             f"{self.num_kv_heads}, {self.head_dim}], got slots {slots.shape}, "
                             f"k {k.shape}, v {v.shape}")
        n = self.num_pages * self.page_size
        valid = slots >= 0  # [T]
        idx = jnp.where(valid, slots, n)  # out of bounds -> dropped (never wrap -1)
        scales, amax, seen = self._fp8_scales(k, v, valid)

        def scatter(pages: KVPages, new: KVPages) -> KVPages:
            def one(page, upd):
                flat = page.reshape(n, *page.shape[2:])
                flat = flat.at[idx].set(upd.astype(page.dtype), mode="drop")
                return flat.reshape(page.shape)
            return jax.tree.map(one, pages, new)

        new_k = quantize_tokens(k, self.dtype, scales[0])
        new_v = quantize_tokens(v, self.dtype, scales[1])
        return dataclasses.replace(self, k=scatter(self.k, new_k), v=scatter(self.v, new_v),
                                   fp8_amax=amax, fp8_seen=seen)

    def _fp8_scales(self, k: jax.Array, v: jax.Array, valid: jax.Array):
        """Calibrated FP8: this write's per-token scales (k [T, K], v [T, K]), or (None, None)
        without calibration, and the updated running amax and token count."""
        if not self.calibration_tokens:
            return (None, None), self.fp8_amax, self.fp8_seen
        tok_amax = jnp.max(jnp.abs(jnp.stack([k, v]).astype(jnp.float32)), -1)  # [2, T, K]
        rank = self.fp8_seen + jnp.cumsum(valid) - 1  # [T] index among tokens ever written
        calibrating = valid & (rank < self.calibration_tokens)  # [T]
        new = jnp.max(jnp.where(calibrating[None, :, None], tok_amax, 0.0), axis=1)  # [2, K]
        amax = jnp.maximum(self.fp8_amax, new)  # [2, K]
        seen = jnp.minimum(self.fp8_seen + valid.sum(dtype=jnp.int32), self.calibration_tokens)
        scales = jnp.broadcast_to(amax_scale(amax)[:, None, :], tok_amax.shape)  # [2, T, K]
        return (scales[0], scales[1]), amax, seen

    def gather(self, block_tables: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Dequantized K and V of each sequence's table pages, in logical order:
        ``[B, Pt]`` -> k, v ``[B, Pt * P, K, D]`` float32 (position t at index t).

        Table entries outside ``[0, num_pages)`` read page 0 or N-1 (clipped): only entries a
        sequence does not use may hold such values, and those positions are masked."""
        b, pt = block_tables.shape
        ids = jnp.clip(block_tables, 0, self.num_pages - 1)

        def read(pages: KVPages) -> jax.Array:
            x = pages.map(lambda a: jnp.take(a, ids, axis=0)).dequantize()  # [B, Pt, P, K, D]
            return x.reshape(b, pt * self.page_size, *x.shape[3:])

        return read(self.k), read(self.v)


# ---- value checks (host side) -------------------------------------------------------------------


def check_tables(block_tables, start, end, page_size: int, num_pages: int, what: str) -> None:
    """Values of one write + attend step, on the host (numpy):

    * ``0 <= start[b] <= end[b] <= Pt * page_size`` (``what`` names the argument they came from);
    * every table entry a sequence uses (pages holding positions ``[0, end[b])``) is a page id in
      ``[0, num_pages)``, and no page appears twice among them;
    * no page that sequence ``b`` writes (positions ``[start[b], end[b])``) is used by another
      sequence (pages only read, e.g. a shared prefix, may be shared).
    """
    bt = np.asarray(block_tables)
    start, end = np.asarray(start), np.asarray(end)
    cap = bt.shape[1] * page_size
    for b in range(bt.shape[0]):
        if not 0 <= start[b] <= end[b] <= cap:
            raise ValueError(
                f"{what}: sequence {b} covers positions [{start[b]}, {end[b]}), outside the "
                f"block table's capacity [0, {cap}) ({bt.shape[1]} pages x {page_size})")
    used = [bt[b, : -(-end[b] // page_size)] for b in range(bt.shape[0])]
    for b, pages in enumerate(used):
        bad = (pages < 0) | (pages >= num_pages)
        if bad.any():
            raise ValueError(f"block_tables: sequence {b} uses page id {pages[bad][0]}, "
                             f"expected ids in [0, {num_pages})")
        if len(set(pages.tolist())) != len(pages):
            raise ValueError(f"block_tables: sequence {b} lists a page twice: {pages.tolist()}")
    for b in range(bt.shape[0]):
        written = set(bt[b, start[b] // page_size: -(-end[b] // page_size)].tolist())
        for o, pages in enumerate(used):
            shared = written & set(pages.tolist()) if o != b else set()
            if shared:
                raise ValueError(f"block_tables: sequence {b} writes page(s) {sorted(shared)} "
                                 f"that sequence {o} also uses")
