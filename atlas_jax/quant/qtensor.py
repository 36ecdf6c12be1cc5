"""``QTensor``: a quantized ``[*L, N, K]`` weight as a pytree, with quantize / dequantize.

Arrays are pytree leaves; ``format``, ``shape`` and ``block`` are static metadata, so ``jax.jit``
specializes on the format and ``tree_map`` sees only the arrays. Weights are ``[out, in]`` =
``[N, K]`` with optional leading dims ``[*L]`` (experts), quantized along K.

Constructors validate dtypes and shapes and raise ``ValueError`` naming the argument, the
expected and the actual value. The bare dataclass constructor does not validate (pytree
unflattening must accept any leaves); build QTensors through :func:`quantize` or the
``from_*`` classmethods.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax

from atlas_jax.config import Format
from atlas_jax.quant import fp8, mxfp4, nvfp4

_FLOATS = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))
_NATIVE_BLOCK = {
    Format.BF16: (1, 1),
    Format.NVFP4: (1, nvfp4.BLOCK),
    Format.MXFP4: (1, mxfp4.BLOCK),
}
_FP8_DEFAULT_BLOCK = (128, 128)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["data", "scale", "global_scale"],
    meta_fields=["format", "shape", "block"],
)
@dataclasses.dataclass(frozen=True, eq=False)
class QTensor:
    """A weight ``[*L, N, K]`` in one of the :class:`Format` s.

    Dequantized value of element ``[*l, n, k]``:
    BF16 ``data``; FP8_BLOCK ``data * scale[*l, n // b0, k // b1]``;
    NVFP4 ``e2m1(data) * scale[*l, n, k // 16] * global_scale[*l, n // (N // R)]``;
    MXFP4 ``e2m1(data) * 2^(scale[*l, n, k // 32] - 127)``.
    """

    # BF16: [*L, N, K] bf16/f16/f32 | FP8_BLOCK: [*L, N, K] float8_e4m3fn
    # NVFP4, MXFP4: [*L, N, K//2] uint8, two E2M1 codes per byte, low nibble = even k
    data: jax.Array
    # NVFP4: [*L, N, K//16] float8_e4m3fn | MXFP4: [*L, N, K//32] uint8 raw E8M0
    # FP8_BLOCK: [*L, ceil(N/b0), ceil(K/b1)] float32 scale_inv | BF16: None
    scale: jax.Array | None
    # NVFP4: [*L, R] float32 global multiplier, row n uses segment n // (N // R) | else None
    global_scale: jax.Array | None
    format: Format
    shape: tuple[int, ...]  # logical [*L, N, K]
    block: tuple[int, int]  # (1, 16) NVFP4, (1, 32) MXFP4, (b0, b1) FP8_BLOCK, (1, 1) BF16

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of all arrays (data and scales)."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))

    def take(self, indices, axis: int = 0) -> QTensor:
        """Gather along a leading dim (e.g. the selected experts); works under jit.

        ``indices`` may have any shape; it replaces dim ``axis`` as in ``jnp.take``. Out-of-range
        indices gather fill values that dequantize to NaN in every format (``mode="fill"``).
        """
        lead = self.ndim - 2
        ax = axis + self.ndim if axis < 0 else axis
        if not 0 <= ax < lead:
            raise ValueError(f"axis: expected a leading axis of shape {self.shape}, got {axis}")
        idx = jnp.asarray(indices)
        if not jnp.issubdtype(idx.dtype, jnp.integer):
            raise ValueError(f"indices: expected an integer dtype, got {idx.dtype}")
        take = lambda x: None if x is None else jnp.take(x, idx, axis=ax, mode="fill")
        return dataclasses.replace(
            self,
            data=take(self.data),
            scale=take(self.scale),
            global_scale=take(self.global_scale),
            shape=self.shape[:ax] + idx.shape + self.shape[ax + 1 :],
        )

    def stacked(self) -> QTensor:
        """This weight as a one-element stack ``[1, *shape]`` (e.g. a shared expert run through
        an op that takes expert stacks)."""
        add = lambda x: None if x is None else x[None]
        return dataclasses.replace(self, data=add(self.data), scale=add(self.scale),
                                   global_scale=add(self.global_scale), shape=(1, *self.shape))

    # ---- constructors from checkpoint tensors -------------------------------------------------

    @classmethod
    def from_float(cls, w, dtype=jnp.bfloat16) -> QTensor:
        """BF16 passthrough: ``quantize(w, Format.BF16, dtype=dtype)``."""
        return quantize(w, Format.BF16, dtype=dtype)

    @classmethod
    def from_nvfp4_modelopt(cls, weight_u8, weight_scale_e4m3, weight_scale_2) -> QTensor:
        """ModelOpt NVFP4: ``weight`` uint8 [*L, N, K//2], ``weight_scale`` float8_e4m3fn (or its
        uint8 bits) [*L, N, K//16], ``weight_scale_2`` float32 global: scalar, [*L] or [*L, R]."""
        data, scale, lead, n = _nvfp4_arrays(
            "weight_u8", weight_u8, "weight_scale_e4m3", weight_scale_e4m3
        )
        g = _global_scale("weight_scale_2", weight_scale_2, lead, n)
        return _nvfp4_qtensor(data, scale, g)

    @classmethod
    def from_nvfp4_compressed_tensors(
        cls, weight_packed, weight_scale, weight_global_scale
    ) -> QTensor:
        """compressed-tensors NVFP4: the layout of ModelOpt, but the stored global is inverted
        (``g = 1 / weight_global_scale``; the reciprocal is rounded once, in float32)."""
        data, scale, lead, n = _nvfp4_arrays(
            "weight_packed", weight_packed, "weight_scale", weight_scale
        )
        g = 1.0 / _global_scale("weight_global_scale", weight_global_scale, lead, n)
        return _nvfp4_qtensor(data, scale, g)

    @classmethod
    def from_mxfp4(cls, blocks_u8, scales_u8) -> QTensor:
        """gpt-oss MXFP4: ``*_blocks`` uint8 [*L, N, K//32, 16], ``*_scales`` uint8 [*L, N, K//32]
        (raw E8M0 bytes)."""
        blocks = _array("blocks_u8", blocks_u8, (jnp.uint8,))
        if blocks.ndim < 3 or blocks.shape[-1] != 16:
            raise ValueError(f"blocks_u8: expected shape [*L, N, K//32, 16], got {blocks.shape}")
        *lead, n, nb, _ = blocks.shape
        scales = _array("scales_u8", scales_u8, (jnp.uint8,))
        _check_shape("scales_u8", scales, (*lead, n, nb))
        return cls(
            data=blocks.reshape(*lead, n, nb * 16),
            scale=scales,
            global_scale=None,
            format=Format.MXFP4,
            shape=(*lead, n, nb * mxfp4.BLOCK),
            block=_NATIVE_BLOCK[Format.MXFP4],
        )

    @classmethod
    def from_fp8_block(
        cls, weight_e4m3, weight_scale_inv, block_size=_FP8_DEFAULT_BLOCK
    ) -> QTensor:
        """DeepSeek-V3 FP8: ``weight`` float8_e4m3fn (or its uint8 bits) [*L, N, K],
        ``weight_scale_inv`` [*L, ceil(N/b0), ceil(K/b1)] float32 (bf16/f16 upcast exactly)."""
        block = _block_size(block_size)
        data = _e4m3("weight_e4m3", weight_e4m3)
        _check_min_ndim("weight_e4m3", data, 2, "[*L, N, K]")
        scale = _array("weight_scale_inv", weight_scale_inv, _FLOATS).astype(jnp.float32)
        nb0, nb1 = fp8.num_blocks(data.shape, block)
        _check_shape("weight_scale_inv", scale, (*data.shape[:-2], nb0, nb1))
        return cls(data, scale, None, Format.FP8_BLOCK, tuple(data.shape), block)


# ---- quantize / dequantize / concat_rows --------------------------------------------------------


def quantize(w, fmt: Format, *, block_size=None, dtype=jnp.bfloat16) -> QTensor:
    """Quantize ``w [..., N, K]`` (bf16/f16/f32) along K into ``fmt``.

    ``block_size``: FP8_BLOCK's ``(b0, b1)`` (default (128, 128)); other formats have a fixed
    block and accept only ``None`` or that block.
    ``dtype``: storage dtype of Format.BF16 only (default bfloat16, as the format's name says;
    ``None`` keeps ``w``'s own float dtype, e.g. float32 reference weights). Other formats
    ignore it.
    """
    w = jnp.asarray(w)
    if w.dtype not in _FLOATS:
        raise ValueError(f"w: expected dtype bfloat16, float16 or float32, got {w.dtype}")
    _check_min_ndim("w", w, 2, "[..., N, K]")
    shape = tuple(w.shape)
    match fmt:
        case Format.BF16:
            _native_block(fmt, block_size)
            data = w if dtype is None else w.astype(_float_dtype(dtype))
            return QTensor(data, None, None, fmt, shape, (1, 1))
        case Format.FP8_BLOCK:
            block = _block_size(_FP8_DEFAULT_BLOCK if block_size is None else block_size)
            data, scale = fp8.quantize(w, block)
            return QTensor(data, scale, None, fmt, shape, block)
        case Format.NVFP4:
            block = _native_block(fmt, block_size)
            _check_k(w, fmt, block[1])
            data, scale, g = nvfp4.quantize(w)
            return QTensor(data, scale, g, fmt, shape, block)
        case Format.MXFP4:
            block = _native_block(fmt, block_size)
            _check_k(w, fmt, block[1])
            data, scale = mxfp4.quantize(w)
            return QTensor(data, scale, None, fmt, shape, block)
        case _:
            raise ValueError(f"fmt: expected a Format, got {fmt!r}")


def dequantize(qt: QTensor, dtype=jnp.float32) -> jax.Array:
    """``qt`` -> dense ``[..., N, K]`` in ``dtype`` (computed in float32)."""
    if not isinstance(qt, QTensor):
        raise TypeError(f"qt: expected a QTensor, got {type(qt).__name__}")
    match qt.format:
        case Format.BF16:
            return qt.data.astype(dtype)
        case Format.FP8_BLOCK:
            return fp8.dequantize(qt.data, qt.scale, qt.block, dtype)
        case Format.NVFP4:
            return nvfp4.dequantize(qt.data, qt.scale, qt.global_scale, dtype)
        case Format.MXFP4:
            return mxfp4.dequantize(qt.data, qt.scale, dtype)
        case _:
            raise ValueError(f"qt.format: expected a Format, got {qt.format!r}")


def concat_rows(a: QTensor, b: QTensor) -> QTensor:
    """Concatenate along N: ``[*L, Na, K] ++ [*L, Nb, K] -> [*L, Na + Nb, K]`` (fuses gate|up).

    FP8_BLOCK with ``Na % b0 != 0`` (e.g. gate rows fewer than 128) first re-blocks both to
    ``b0' = gcd(Na, b0)`` rows by repeating scale rows, which is exact. NVFP4 keeps one
    global segment when both are single-segment and concretely equal; otherwise (different, or
    traced under jit) the segments are concatenated, ``R = Ra + Rb``, which needs the same rows
    per segment (``Na / Ra == Nb / Rb``).
    """
    for name, x in (("a", a), ("b", b)):
        if not isinstance(x, QTensor):
            raise TypeError(f"{name}: expected a QTensor, got {type(x).__name__}")
    if (a.format, a.block) != (b.format, b.block):
        raise ValueError(
            f"b: expected format {a.format} block {a.block} (as a), got {b.format} {b.block}"
        )
    if a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-1]:
        raise ValueError(f"b: expected shape [{a.shape[:-2]}..., N, {a.shape[-1]}], got {b.shape}")
    if a.data.dtype != b.data.dtype:
        raise ValueError(f"b.data: expected dtype {a.data.dtype} (as a), got {b.data.dtype}")
    na, nb = a.shape[-2], b.shape[-2]
    g = None
    match a.format:
        case Format.FP8_BLOCK if na % a.block[0]:
            rows = math.gcd(na, a.block[0])
            return concat_rows(reblock_rows(a, rows), reblock_rows(b, rows))
        case Format.NVFP4:
            g = _concat_globals(a.global_scale, b.global_scale, na, nb)
    cat = lambda x, y: None if x is None else jnp.concatenate([x, y], axis=-2)
    shape = (*a.shape[:-2], na + nb, a.shape[-1])
    return QTensor(cat(a.data, b.data), cat(a.scale, b.scale), g, a.format, shape, a.block)


def reblock_rows(q: QTensor, b0: int) -> QTensor:
    """FP8_BLOCK ``q`` with scale blocks of ``b0`` rows (``b0`` divides ``q.block[0]``): each old
    scale row is repeated for the new blocks inside it, so the values are unchanged."""
    old_b0, b1 = q.block
    if q.format is not Format.FP8_BLOCK or old_b0 % b0:
        raise ValueError(f"reblock_rows: needs FP8_BLOCK with b0={b0} dividing {old_b0}, "
                         f"got {q.format.value} block {q.block}")
    nb0 = -(-q.shape[-2] // b0)
    rows = (jnp.arange(nb0) * b0) // old_b0  # [nb0'] old block of each new block
    scale = jnp.take(q.scale, rows, axis=-2)
    return QTensor(q.data, scale, None, q.format, q.shape, (b0, b1))


# ---- helpers -------------------------------------------------------------------------------------


def _concat_globals(ga: jax.Array, gb: jax.Array, na: int, nb: int) -> jax.Array:
    ra, rb = ga.shape[-1], gb.shape[-1]
    concrete = not isinstance(ga, jax.core.Tracer) and not isinstance(gb, jax.core.Tracer)
    if ra == rb == 1 and (ga is gb or (concrete and bool(jnp.array_equal(ga, gb)))):
        return ga
    if na // ra != nb // rb:
        raise ValueError(
            f"b: expected {na // ra} rows per global-scale segment (as a), got {nb // rb} "
            f"(N={nb}, R={rb})"
        )
    return jnp.concatenate([ga, gb], axis=-1)  # [*L, Ra + Rb]


def _nvfp4_qtensor(data: jax.Array, scale: jax.Array, g: jax.Array) -> QTensor:
    *lead, n, half_k = data.shape
    return QTensor(data, scale, g, Format.NVFP4, (*lead, n, 2 * half_k), (1, nvfp4.BLOCK))


def _nvfp4_arrays(data_name, data, scale_name, scale):
    """Validate NVFP4 packed data and E4M3 block scales; return them with ``[*L]`` and N."""
    data = _array(data_name, data, (jnp.uint8,))
    _check_min_ndim(data_name, data, 2, "[*L, N, K//2]")
    *lead, n, half_k = data.shape
    if half_k % (nvfp4.BLOCK // 2):
        raise ValueError(
            f"{data_name}: expected last dim K//2 a multiple of 8 (K a multiple of 16), "
            f"got {half_k}"
        )
    scale = _e4m3(scale_name, scale)
    _check_shape(scale_name, scale, (*lead, n, 2 * half_k // nvfp4.BLOCK))
    return data, scale, tuple(lead), n


def _global_scale(name: str, x, lead: tuple[int, ...], n: int) -> jax.Array:
    """A float global as scalar, [*L] or [*L, R] (R dividing N) -> [*L, R] float32."""
    x = _array(name, x, _FLOATS).astype(jnp.float32)
    if x.shape == ():
        return jnp.broadcast_to(x, (*lead, 1))
    if x.shape == lead:
        return x[..., None]
    if x.ndim == len(lead) + 1 and x.shape[:-1] == lead and n % x.shape[-1] == 0:
        return x
    raise ValueError(
        f"{name}: expected shape (), {lead} or {(*lead, 'R')} with R dividing N={n}, got {x.shape}"
    )


def _array(name: str, x, dtypes) -> jax.Array:
    x = jnp.asarray(x)
    allowed = [jnp.dtype(d) for d in dtypes]
    if x.dtype not in allowed:
        names = " or ".join(d.name for d in allowed)
        raise ValueError(f"{name}: expected dtype {names}, got {x.dtype}")
    return x


def _e4m3(name: str, x) -> jax.Array:
    """float8_e4m3fn, or uint8 raw bits bitcast to it."""
    x = _array(name, x, (jnp.float8_e4m3fn, jnp.uint8))
    return lax.bitcast_convert_type(x, jnp.float8_e4m3fn) if x.dtype == jnp.uint8 else x


def _check_shape(name: str, x: jax.Array, expected: tuple[int, ...]) -> None:
    if x.shape != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {x.shape}")


def _check_min_ndim(name: str, x: jax.Array, ndim: int, layout: str) -> None:
    if x.ndim < ndim:
        raise ValueError(f"{name}: expected shape {layout}, got {x.shape}")


def _check_k(w: jax.Array, fmt: Format, block: int) -> None:
    if w.shape[-1] % block:
        raise ValueError(
            f"w: expected K (last dim) a multiple of the {fmt.name} block {block}, "
            f"got K={w.shape[-1]}"
        )


def _block_size(block_size) -> tuple[int, int]:
    ok = (
        isinstance(block_size, tuple | list)
        and len(block_size) == 2
        and all(
            isinstance(b, numbers.Integral) and not isinstance(b, bool) and b > 0
            for b in block_size
        )
    )
    if not ok:
        raise ValueError(f"block_size: expected two positive ints (b0, b1), got {block_size!r}")
    return int(block_size[0]), int(block_size[1])


def _native_block(fmt: Format, block_size) -> tuple[int, int]:
    native = _NATIVE_BLOCK[fmt]
    if block_size is not None and tuple(block_size) != native:
        raise ValueError(f"block_size: {fmt.name} has the fixed block {native}, got {block_size!r}")
    return native


def _float_dtype(dtype) -> jnp.dtype:
    dt = jnp.dtype(dtype)
    if dt not in _FLOATS:
        raise ValueError(f"dtype: expected bfloat16, float16 or float32, got {dt}")
    return dt
