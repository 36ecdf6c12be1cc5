"""Run the Mosaic GPU decode kernels' register-level blocks on the CPU.

The register-level blocks of ``pallas_kernels.moe_decode.mosaic`` (FP4 scale loads, factors,
the MXFP4 row-max pre-pass, code conversion, the epilogue's loads, the one launch's h program)
are ``plgpu.inline_mgpu`` bodies that build MLIR (``arith``, ``vector``, ``math``, ``llvm``
loads and stores, inline PTX) one thread's worth at a time; interpret mode runs their jnp
twins instead, so before this only the GPU ran them. ``emulate(monkeypatch, mosaic)`` swaps
the names those bodies use in the ``mosaic`` module for numpy stand-ins that run the same
Python over all 128 threads of a warpgroup at once:

- a value is a numpy array with one row a thread: ``[128]`` (``uint32`` for i32, ``uint16`` /
  ``uint8`` for i16 / i8, ``float16`` / ``float32``, ``bool`` for i1) or ``[128, n]`` for a
  vector; ``arith`` / ``vector`` ops act lane by lane with the MLIR semantics the bodies use
  (wrapping unsigned integers, ``truncf`` rounding to nearest even, f16 products rounded once);
- loads and stores read and write a byte image of the ref (``Memory``) at each thread's byte
  offset, and fail on an offset out of bounds or not aligned to the access's size (what the
  GPU would fault on); ``mgpu.utils.when`` blocks run on their lanes only, ``fori`` loops are
  Python loops, barriers do nothing (the lanes run in step);
- the two PTX strings the bodies emit (e4m3x2 -> f16x2) and the butterfly shuffle are computed;
- ``plgpu.inline_mgpu`` calls its body with these values: refs as ``Memory``, splat scalars as
  their value, register arrays (``Frag``) passed through; a body's ``FragmentedArray`` comes
  back as a ``Frag`` whose registers ``wgmma_matrix`` / ``row_values`` read in the WGMMA
  layout (thread ``t`` of warp ``w = t // 32``, lane ``l``: rows ``16 w + l // 4 (+ 8)``,
  columns ``8 b + 2 (l % 4) (+ 1)``).

``smem_image`` lays a tile out as Mosaic GPU's tiling and swizzle transforms do in SMEM.
"""

from __future__ import annotations

import contextlib
import types

import ml_dtypes
import numpy as np
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

THREADS = 128
_TID = np.arange(THREADS, dtype=np.uint32)


# -- types ---------------------------------------------------------------------------------------


class _Int:
    def __init__(self, width: int):
        self.dtype = np.dtype({1: np.bool_, 8: np.uint8, 16: np.uint16, 32: np.uint32,
                               64: np.uint64}[width])


class _Float:
    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)


class _Vector:
    def __init__(self, shape, element):
        (self.length,) = shape
        self.dtype = element.dtype


def _fake_ir():
    return types.SimpleNamespace(
        IntegerType=types.SimpleNamespace(get_signless=_Int),
        F16Type=types.SimpleNamespace(get=lambda: _Float(np.float16)),
        F32Type=types.SimpleNamespace(get=lambda: _Float(np.float32)),
        BF16Type=types.SimpleNamespace(get=lambda: _Float(ml_dtypes.bfloat16)),
        VectorType=types.SimpleNamespace(get=_Vector),
        DenseI64ArrayAttr=types.SimpleNamespace(get=list),
    )


def _bitcast(v: np.ndarray, ty) -> np.ndarray:
    """The same bits a thread as ``ty``."""
    raw = np.ascontiguousarray(v).reshape(THREADS, -1).view(np.uint8).reshape(THREADS, -1)
    out = raw.view(ty.dtype)
    if isinstance(ty, _Vector):
        assert out.shape == (THREADS, ty.length), (v.shape, v.dtype, ty.length)
        return out
    assert out.shape == (THREADS, 1), (v.shape, v.dtype, ty.dtype)
    return out[:, 0]


# -- arith, vector -------------------------------------------------------------------------------


def _same(a, b):
    b = np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    return a, b


def _shift(a, b, op):
    a, b = _same(a, b)
    assert np.all(b < 8 * a.dtype.itemsize), "shift past the width: undefined in MLIR"
    return op(a, b)


def _signed(a):
    return a.view({1: np.int8, 2: np.int16, 4: np.int32}[a.dtype.itemsize])


def _fake_arith():
    def binary(op):
        return lambda a, b: op(*_same(a, b)).astype(a.dtype)

    def cmpi(pred, a, b):
        a, b = _same(a, b)
        return {"uge": np.greater_equal, "ult": np.less, "eq": np.equal, "ne": np.not_equal,
                "ugt": np.greater, "ule": np.less_equal}[pred](a, b)

    def divui(a, b):
        a, b = _same(a, b)
        assert np.all(b != 0), "division by zero"
        return a // b

    def remui(a, b):
        a, b = _same(a, b)
        assert np.all(b != 0), "remainder by zero"
        return a % b

    def select(c, a, b):
        a, b = _same(a, b)
        return np.where(c.reshape(c.shape + (1,) * (a.ndim - c.ndim)), a, b)

    def mulf(a, b):
        a, b = _same(a, b)
        # f16 x f16 is exact in f32; one rounding to f16 (round to nearest even), as HMUL2
        return (a.astype(np.float32) * b.astype(np.float32)).astype(a.dtype)

    return types.SimpleNamespace(
        addi=binary(np.add), subi=binary(np.subtract), muli=binary(np.multiply),
        andi=binary(np.bitwise_and), ori=binary(np.bitwise_or), xori=binary(np.bitwise_xor),
        maxui=binary(np.maximum), minui=binary(np.minimum), divui=divui, remui=remui,
        maxsi=lambda a, b: np.maximum(*map(_signed, _same(a, b))).view(a.dtype),
        shli=lambda a, b: _shift(a, b, np.left_shift),
        shrui=lambda a, b: _shift(a, b, np.right_shift),
        cmpi=cmpi, select=select, mulf=mulf,
        addf=lambda a, b: np.add(*_same(a, b)), divf=lambda a, b: np.divide(*_same(a, b)),
        negf=np.negative, maximumf=_nan_max, minimumf=_nan_min,
        minsi=lambda a, b: np.minimum(*map(_signed, _same(a, b))).view(a.dtype),
        constant=lambda ty, v: np.full(THREADS, v, ty.dtype),
        extf=lambda ty, v: (_check_widen(v, ty), v.astype(ty.dtype))[1],
        CmpIPredicate=types.SimpleNamespace(
            **{p: p for p in ("uge", "ult", "eq", "ne", "ugt", "ule")}),
        extui=lambda ty, v: (_check_widen(v, ty), v.astype(ty.dtype))[1],
        trunci=lambda ty, v: v.astype(ty.dtype),
        truncf=lambda ty, v: v.astype(ty.dtype),
        bitcast=lambda ty, v: _bitcast(v, ty),
    )


def _nan_max(a, b):  # arith.maximumf / minimumf: NaN if either is (np.maximum's rule)
    return np.maximum(*_same(a, b))


def _nan_min(a, b):
    return np.minimum(*_same(a, b))


def _check_widen(v, ty):
    assert np.dtype(ty.dtype).itemsize > v.dtype.itemsize, "extui must widen"


def _fake_vector():
    def extract(vec, *, dynamic_position, static_position):
        assert not dynamic_position
        (i,) = static_position
        return vec[:, i]

    def shuffle(a, b, mask):
        return np.concatenate([a, b], axis=1)[:, list(mask)]

    def from_elements(ty, values):
        out = np.stack(values, axis=1)
        assert out.shape == (THREADS, ty.length) and out.dtype == ty.dtype
        return out

    return types.SimpleNamespace(extract=extract, shuffle=shuffle, from_elements=from_elements)


def _fake_math():
    return types.SimpleNamespace(exp=np.exp, tanh=np.tanh, absf=np.abs)


# -- memory, PTX, registers ----------------------------------------------------------------------


class Memory:
    """A ref's bytes, as a thread's loads and stores see them (row-major, or
    ``smem_image``'s layout); ``array()`` reads them back as the ref."""

    def __init__(self, data):
        data = np.asarray(data)
        self.bytes = np.ascontiguousarray(data).reshape(-1).view(np.uint8).copy()
        self.shape, self.dtype = data.shape, data.dtype

    def array(self) -> np.ndarray:
        return self.bytes.view(self.dtype).reshape(self.shape)


_ACTIVE = [np.ones(THREADS, bool)]  # the lanes an ``mgpu.utils.when`` block runs


@contextlib.contextmanager
def _when(cond):
    _ACTIVE.append(_ACTIVE[-1] & np.asarray(cond, bool))
    try:
        yield
    finally:
        _ACTIVE.pop()


def _span(mem: Memory, offset, size: int) -> np.ndarray:
    """The byte indices ``[128, size]`` a ``size``-byte access at ``offset`` touches (the
    active lanes checked for bounds and alignment; the others point at byte 0)."""
    offset = np.asarray(offset, np.int64)
    active = _ACTIVE[-1]
    on = offset[active]
    assert np.all(on % size == 0), f"a {size}-byte access at an unaligned offset"
    assert np.all(on >= 0) and np.all(on + size <= mem.bytes.size), (
        f"a {size}-byte access past the ref's {mem.bytes.size} bytes")
    return np.where(active, offset, 0)[:, None] + np.arange(size)


def _size(ty) -> int:
    return np.dtype(ty.dtype).itemsize * getattr(ty, "length", 1)


def _load(mem: Memory, offset, ty):
    out = mem.bytes[_span(mem, offset, _size(ty))].view(ty.dtype)
    out = np.where(_ACTIVE[-1][:, None], out, 0).astype(ty.dtype)
    return out if isinstance(ty, _Vector) else out[:, 0]


def _gep(mem: Memory, offset):
    return mem, offset


def _store(value, pointer):
    mem, offset = pointer
    raw = np.ascontiguousarray(value).reshape(THREADS, -1).view(np.uint8).reshape(THREADS, -1)
    at = _span(mem, offset, raw.shape[1])
    active = _ACTIVE[-1]
    mem.bytes[at[active].reshape(-1)] = raw[active].reshape(-1)


def _fori(bound, carry):
    """``mgpu.utils.fori``: the body run ``bound`` times (a value all lanes share)."""
    n = np.asarray(bound)
    assert (n == n[0]).all(), "a loop bound must be uniform"

    def wrap(body):
        c = carry
        for i in range(int(n[0])):
            c = body(np.full(THREADS, i, np.uint32), c)
        return types.SimpleNamespace(result=c)

    return wrap


def _e4m3x2_to_f16x2(pair16: np.ndarray) -> np.ndarray:
    """``cvt.rn.f16x2.e4m3x2``: the low byte to the low half, the high byte to the high."""
    e4m3 = pair16.view(np.uint8).reshape(THREADS, 2).view(ml_dtypes.float8_e4m3fn)
    return e4m3.astype(np.float16).view(np.uint32)[:, 0]


_PTX = {
    "cvt.rn.f16x2.e4m3x2 $0, $1;": lambda a: (_e4m3x2_to_f16x2(a),),
    ("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
     "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }"): lambda a: tuple(
         _e4m3x2_to_f16x2(h) for h in a.view(np.uint16).reshape(THREADS, 2).T.copy()),
}


def _inline_ptx(asm, *args, result_types):
    if asm not in _PTX:
        raise NotImplementedError(f"mgpu_emulator: no stand-in for the PTX {asm!r}")
    out = _PTX[asm](*args)
    return out if isinstance(result_types, (list, tuple)) else out[0]


def _shfl_bfly(v, d):
    return v[(_TID & ~np.uint32(31)) | ((_TID & 31) ^ d)]


class Frag:
    """A register array: ``registers`` (an object array of per-thread values), as a body's
    ``mgpu.FragmentedArray`` or a splat scalar argument."""

    def __init__(self, *, _registers, _layout=None, _is_signed=None):
        self.registers = _registers
        self.layout = _layout


def _splat(value) -> Frag:
    regs = np.empty((), object)
    regs[()] = np.full(THREADS, int(value) & 0xFFFFFFFF, np.uint32)
    return Frag(_registers=regs)


def _i32(v):
    return np.full(THREADS, int(v) & 0xFFFFFFFF, np.uint32)


def _thread_rows():
    lane, warp = _TID % 32, _TID // 32 % 4
    return 16 * warp + lane // 4, warp, lane // 4, lane % 4


def _inline_mgpu(*, arg_types=(), return_type=None):
    del return_type

    def wrap(body):
        def call(*args):
            fakes = []
            for a, t in zip(args, arg_types, strict=True):
                if isinstance(a, (Frag, Memory)):
                    fakes.append(a)
                elif isinstance(t, plgpu.RefType):
                    fakes.append(Memory(a))
                elif t == plgpu.Layout.WG_SPLAT:
                    fakes.append(_splat(a))
                else:
                    raise TypeError(f"mgpu_emulator: no stand-in for a {t} argument {a!r}")
            return body(None, *fakes)

        return call

    return wrap


class _Plgpu:
    """``plgpu`` with ``inline_mgpu`` replaced."""

    inline_mgpu = staticmethod(_inline_mgpu)

    def __getattr__(self, name):
        return getattr(plgpu, name)


@contextlib.contextmanager
def emulate(monkeypatch, module):
    """``module``'s (``mosaic``) MLIR-building names replaced by the numpy stand-ins."""
    fake_mgpu = types.SimpleNamespace(
        utils=types.SimpleNamespace(bitcast=lambda v, ty: _bitcast(v, ty),
                                    inline_ptx=_inline_ptx, shfl_bfly=_shfl_bfly,
                                    memref_ptr=lambda m: m, thread_idx=lambda: _TID.copy(),
                                    warpgroup_barrier=lambda: None, when=_when, fori=_fori),
        FragmentedArray=Frag, WGMMA_LAYOUT=mgpu.WGMMA_LAYOUT,
        WGMMA_ROW_LAYOUT=mgpu.WGMMA_ROW_LAYOUT)
    with monkeypatch.context() as m:
        fake_ir = _fake_ir()
        for name, value in dict(
                arith=_fake_arith(), vector=_fake_vector(), ir=fake_ir, mgpu=fake_mgpu,
                plgpu=_Plgpu(), mlir_math=_fake_math(), llvm=types.SimpleNamespace(store=_store),
                _load=_load, _gep=_gep, _i32=_i32, _thread_rows=_thread_rows,
                _BIAS_TYPES={np.dtype(ml_dtypes.bfloat16): fake_ir.BF16Type,
                             np.dtype(np.float16): fake_ir.F16Type,
                             np.dtype(np.float32): fake_ir.F32Type}).items():
            m.setattr(module, name, value)
        yield


# -- reading results, laying out SMEM ------------------------------------------------------------


def _rows_of(i: int) -> np.ndarray:
    return 16 * (_TID // 32) + (_TID % 32) // 4 + 8 * i


def wgmma_matrix(frag: Frag, cols: int, rows: int = 64) -> np.ndarray:
    """``[rows, cols]`` from a WGMMA-layout ``Frag`` of two-element (f16x2) registers."""
    regs = frag.registers
    assert regs.shape == mgpu.WGMMA_LAYOUT.registers_shape((rows, cols)), regs.shape
    first = regs[0, 0, 0, 0, 0, 0, 0, 0, 0]
    out = np.zeros((rows, cols), first.dtype)
    seen = np.zeros((rows, cols), bool)
    for b in range(cols // 8):
        for i in range(2):
            v = regs[0, b, 0, 0, i, 0, 0, 0, 0]
            assert v.shape == (THREADS, 2), v.shape
            c = 8 * b + 2 * (_TID % 32 % 4)
            for h in range(2):
                out[_rows_of(i), c + h] = v[:, h]
                seen[_rows_of(i), c + h] = True
    assert seen.all()
    return out


def row_values(frag: Frag, rows: int = 64) -> np.ndarray:
    """``[rows]`` from a WGMMA row ``Frag`` (one one-element register a thread's row half);
    the four threads of a quad, which hold the same rows, must agree."""
    regs = frag.registers
    assert regs.shape == mgpu.WGMMA_ROW_LAYOUT.registers_shape((rows,)), regs.shape
    out = np.zeros(rows, regs[0, 0, 0, 0, 0].dtype)
    for i in range(2):
        v = regs[0, 0, i, 0, 0].reshape(THREADS)
        quads = v.reshape(-1, 4)
        assert (quads == quads[:, :1]).all(), "a quad's threads disagree on their rows"
        out[_rows_of(i)] = v
    return out


def smem_offsets(rows: int, width: int, swizzle: int) -> np.ndarray:
    """``[rows, width]``: the byte offset in SMEM of each byte of a ``[rows, width]``-byte tile
    (rows a multiple of 8, width of ``swizzle``) under Mosaic GPU's ``TilingTransform((8,
    swizzle / itemsize))`` and ``SwizzleTransform(swizzle)``: tiles of 8 rows x ``swizzle``
    bytes, row tile after row tile and, in one, column tile after column tile; in a tile, byte
    ``t = (r % 8) * swizzle + b % swizzle`` has its 16-byte chunk index XOR-ed with ``(t //
    128) % (swizzle // 16)`` (the TMA's swizzle pattern)."""
    r, b = np.meshgrid(np.arange(rows), np.arange(width), indexing="ij")
    t = (r % 8) * swizzle + b % swizzle
    t = t ^ (((t // 128) % (swizzle // 16)) << 4)
    at = (r // 8) * (8 * width) + (b // swizzle) * (8 * swizzle) + t
    assert np.unique(at).size == at.size
    return at


def smem_image(tile: np.ndarray, swizzle: int) -> Memory:
    """``tile [R, B]`` bytes laid out as ``smem_offsets`` says."""
    rows, width = tile.shape
    out = np.zeros(rows * width, np.uint8)
    out[smem_offsets(rows, width, swizzle).reshape(-1)] = np.asarray(tile, np.uint8).reshape(-1)
    return Memory(out)
