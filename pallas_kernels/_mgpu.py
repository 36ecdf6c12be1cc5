"""Helpers of the Mosaic GPU kernels' register-level blocks (``plgpu.inline_mgpu``): i32 / f32
constants, a thread's place in the WGMMA register layout, byte-addressed loads."""

from __future__ import annotations

from jax.experimental.mosaic import gpu as mgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm


def i32(v):
    return mgpu.utils.c(v, ir.IntegerType.get_signless(32))


def f32(v):
    return mgpu.utils.c(v, ir.F32Type.get())


def thread_rows():
    """This thread of the warpgroup in the WGMMA layout, as i32 values: ``(row, w, g, c)``,
    its first row ``16 w + g`` (warp w, row group ``g = lane // 4``; its second row is
    ``row + 8``) and its lane in the quad ``c = lane % 4``."""
    tid = mgpu.utils.thread_idx()
    lane = arith.remui(tid, i32(32))
    warp = arith.remui(arith.divui(tid, i32(32)), i32(4))
    first = arith.muli(warp, i32(16))
    g = arith.divui(lane, i32(4))
    return arith.addi(first, g), warp, g, arith.remui(lane, i32(4))


def gep(ptr, offset):
    """``ptr`` plus ``offset`` bytes (i32)."""
    return mgpu.utils.getelementptr(ptr, [offset], ir.IntegerType.get_signless(8))


def load(ptr, offset, ty):
    """``ty`` at byte ``offset`` (i32) from ``ptr`` (aligned to ``ty``'s size by the caller)."""
    return llvm.load(ty, gep(ptr, offset))
