"""The Mosaic GPU decode kernels' register-level blocks (FP4 scale loads, factors, the row-max
pre-pass, code conversion in parts, the epilogue's loads, the h program), run on the CPU by
``mgpu_emulator`` and compared with the jnp twins that interpret mode runs (``_fp4_*_jnp``,
``_mx_row_*_jnp``, ``rows.h_rows``' math): bit for bit, the h values within a bf16 rounding
(the emulator's ``exp`` is numpy's).

Interpret mode cannot run these blocks (they build MLIR a thread at a time); the compiled
tests run them on the GPU only. Here the same Python runs over a warpgroup's 128 threads in
numpy, so a wrong byte offset, shift, group index, quad shuffle or part boundary shows up on a
CPU, and so does a load out of bounds or misaligned.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.moe_decode import mosaic
from pallas_kernels.moe_decode.mosaic import BLOCK_N, SlotTile
from pallas_kernels.moe_decode.rows import row_width
from tests.mgpu_emulator import Memory, emulate, row_values, smem_image, wgmma_matrix

# (K, step): Qwen3's gate_up (2048) and down (768) in steps of 256, gpt-oss's 2880 in 192 and
# 320, DeepSeek-V3's 7168 in 256, and short K in steps of 64 / 128 / 320; ragged K in steps of
# 256 (FP4_RAGGED_STEP: gpt-oss's 2880, 320 and 704, the last step 64 or 192 wide)
CASES = [(2048, 256), (768, 256), (2880, 192), (2880, 320), (7168, 256), (512, 128),
         (512, 64), (960, 320), (2880, 256), (320, 256), (704, 256)]
EXPERTS, N = 3, 3 * BLOCK_N


def _parts(bk: int) -> list[int]:
    """The part counts a step of ``bk`` takes (parts of a multiple of 8 bytes a thread's row)."""
    return [p for p in (1, 2, 3, 4, 5) if bk // 8 % p == 0 and bk // 8 // p % 8 == 0]


def _scales(rng, fmt: str, k: int) -> np.ndarray:
    """Scales ``[E, N, K / group]``: NVFP4 e4m3 of every finite positive byte, MXFP4 E8M0
    bytes mostly near 127 with rows reaching far below (factors into f16 subnormals and 0)."""
    if fmt == "nvfp4":
        return rng.integers(1, 0x7F, (EXPERTS, N, k // 16), dtype=np.uint8).view(
            ml_dtypes.float8_e4m3fn)
    near = rng.integers(110, 140, (EXPERTS, N, k // 32))
    far = rng.integers(60, 110, (EXPERTS, N, k // 32))
    return np.where(rng.random(near.shape) < 0.2, far, near).astype(np.uint8)


def _groups(fmt: str) -> int:
    return 16 if fmt == "nvfp4" else 32


@pytest.fixture
def emulated(monkeypatch):
    with emulate(monkeypatch, mosaic):
        yield


def _operand_case(fmt, k, bk, parts, split):
    """One program's step: the emulated scale loads, factors (MXFP4: against the rows'
    largest scale over the split's steps) and code conversion (in ``parts``) against the jnp
    twins, column tile 2, for expert 1 and the middle step of the first K split (``split``
    0), or the last expert and the last step of the last split (1: the loads nearest the end
    of the scales). A ragged K's last step: its codes past K zero (the TMA's fill), its
    scales past K zero in the jnp twin's (the interpreter's padding), the emulated loads kept
    on the row's bytes (any finite factor meets zero codes)."""
    rng = np.random.default_rng(bk * 7 + parts + k)
    tile = SlotTile(block_k=bk)
    scale = _scales(rng, fmt, k)
    e, n0 = (1, 2 * BLOCK_N) if split == 0 else (EXPERTS - 1, 2 * BLOCK_N)
    steps = -(-k // bk)
    ragged = k % bk != 0
    splits = 2 if steps >= 4 and steps % 2 == 0 else 1
    per_split = steps // splits
    kb = per_split // 2 if split == 0 else steps - 1
    codes = rng.integers(0, 256, (BLOCK_N, bk // 2), dtype=np.uint8)
    codes[:, max(k - kb * bk, 0) // 2:] = 0  # past K (a ragged last step)
    g = bk // _groups(fmt)
    s = scale[e, n0:n0 + BLOCK_N, kb * g:(kb + 1) * g]
    s = jnp.asarray(np.pad(s, ((0, 0), (0, g - s.shape[1]))))
    top_ref = top = None
    if fmt == "mxfp4":
        first = min(split, splits - 1) * per_split * (bk // 32)
        span = per_split * (bk // 32)
        top_ref = jnp.asarray(scale[e, n0:n0 + BLOCK_N, first:first + span].astype(np.int32)
                              .max(axis=1))
        top = mosaic._mx_row_top_inline(scale, e * N + n0, first, groups=span,
                                        step_groups=bk // 32, ragged=ragged)
        np.testing.assert_array_equal(row_values(top).view(np.uint32), top_ref)
    want = mosaic._fp4_factors_jnp(s, fmt=fmt, top=top_ref)
    bits = mosaic._fp4_scale_bits_inline(scale, e * N + n0, kb, fmt=fmt, tile=tile,
                                         ragged=ragged)
    got = mosaic._fp4_factors_inline(bits, fmt=fmt, tile=tile, top=top)
    operand = np.asarray(mosaic._fp4_operands_jnp(jnp.asarray(codes), want))  # [bn, bk]
    smem = smem_image(codes, mosaic._code_transforms(bk, k)[1].swizzle)
    cols = bk // parts
    for h in range(parts):
        part = mosaic._fp4_operands_inline(smem, got, tile=tile, k=k, part=h, parts=parts)
        np.testing.assert_array_equal(
            wgmma_matrix(part, cols).view(np.uint16),
            operand[:, h * cols:(h + 1) * cols].view(np.uint16), err_msg=f"part {h}")


@pytest.mark.parametrize("k,bk", CASES)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_operands_inline(emulated, fmt, k, bk):
    """A step's f16 A operand (codes x factors, operand column order) from the compiled path's
    blocks equals interpret mode's, bit for bit, in every part count the step takes, with
    MXFP4's factors against the row's largest scale over the program's steps, in the first and
    the second K split."""
    for parts in _parts(bk):
        for split in (0, 1):
            _operand_case(fmt, k, bk, parts, split)


@pytest.mark.parametrize("k,bk,first_step,steps", [
    (2048, 256, 0, 8), (2048, 256, 4, 4), (768, 256, 0, 3), (2880, 192, 0, 15),
    (2880, 192, 5, 5), (2880, 192, 10, 5), (2880, 320, 0, 9), (2880, 320, 3, 3),
    (7168, 256, 0, 28), (7168, 256, 14, 14),
    (512, 128, 0, 4), (512, 64, 2, 6), (2880, 256, 6, 6), (2880, 256, 0, 12),
    (704, 256, 1, 2)])  # ragged: groups past the row's (read as its last load again)
def test_mx_row_top_inline(emulated, k, bk, first_step, steps):
    """The row-max pre-pass (each thread every fourth load of its quad's rows, two butterfly
    shuffles) gives every thread of a quad its two rows' largest E8M0 byte over the program's
    groups, for each load width the strides allow (8 bytes; 2 for gpt-oss's 90-byte rows), and
    its factor ``2^(top - 127 + PLACEMENT)``."""
    rng = np.random.default_rng(k + first_step)
    scale = _scales(rng, "mxfp4", k)
    scale[0, 5, first_step * bk // 32] = 255  # a row whose largest byte is its first
    last = min((first_step + steps) * bk, k) // 32 - 1
    scale[0, 70, last] = 254  # and its last (another tile)
    for e, n0 in [(0, 0), (0, BLOCK_N), (2, 2 * BLOCK_N)]:
        first, span = first_step * bk // 32, steps * bk // 32
        want = scale[e, n0:n0 + BLOCK_N, first:first + span].astype(np.uint32).max(axis=1)
        top = mosaic._mx_row_top_inline(scale, e * N + n0, first, groups=span,
                                        step_groups=bk // 32, ragged=k % bk != 0)
        np.testing.assert_array_equal(row_values(top).view(np.uint32), want)
        factor = row_values(mosaic._mx_row_factor_inline(top))
        np.testing.assert_array_equal(
            factor, np.asarray(mosaic._mx_row_factor_jnp(jnp.asarray(want, jnp.int32))))


def test_emulator_catches_a_wrong_offset(emulated, monkeypatch):
    """The comparisons can fail: the row-max pre-pass with each quad lane's loads moved one
    along (lanes 1-4 instead of 0-3: no lane reads a row's first 8 bytes) misses a row's
    largest byte placed there, and the quads' threads no longer agree."""
    rng = np.random.default_rng(0)
    scale = _scales(rng, "mxfp4", 2048)
    scale[0, 3, 0] = 255
    real = mosaic._thread_rows

    def shifted():
        row, warp, g, quad = real()
        return row, warp, g, (quad + np.uint32(1)).astype(np.uint32)

    want = scale[0, :BLOCK_N].astype(np.uint32).max(axis=1)
    with monkeypatch.context() as m:
        m.setattr(mosaic, "_thread_rows", shifted)
        top = mosaic._mx_row_top_inline(scale, 0, 0, groups=64, step_groups=8)
        with pytest.raises(AssertionError):
            np.testing.assert_array_equal(row_values(top).view(np.uint32), want)
    top = mosaic._mx_row_top_inline(scale, 0, 0, groups=64, step_groups=8)
    np.testing.assert_array_equal(row_values(top).view(np.uint32), want)


def test_emulator_refuses_misaligned_loads(emulated):
    """A load the GPU would fault on (an 8-byte vector at an offset not a multiple of 8) fails
    the emulator too."""
    from tests import mgpu_emulator as em

    mem = Memory(np.arange(64, dtype=np.uint8))
    with pytest.raises(AssertionError, match="unaligned"):
        em._load(mem, np.full(em.THREADS, 4), em._Vector((2,), em._Int(32)))
    with pytest.raises(AssertionError, match="past the ref"):
        em._load(mem, np.full(em.THREADS, 64), em._Int(8))


def _h_reference(gu, rows, first, count, splits, layout, activation, limit, block_k,
                 cols=slice(None)):
    """``rows.h_rows``' math for sorted rows ``[first, first + count)``, h's columns ``cols``
    (scaled against their own max): (f16 rows, factors)."""
    from pallas_kernels.grouped_matmul.reference import GPT_OSS_ALPHA, split_gate_up
    from pallas_kernels.moe_decode import rows as row_launches
    from pallas_kernels.moe_decode.kernel import _epilogue

    g = sum(gu[s * rows + first:s * rows + first + count] for s in range(splits))
    gate, up = split_gate_up(jnp.asarray(g), layout)
    h = row_launches._round_to_bf16(_epilogue(gate, up, activation, limit, GPT_OSS_ALPHA))
    new, factor = row_launches.rows_reference(h[:, cols], block_k)
    return np.asarray(new), np.asarray(factor)


# (I, layout, activation, limit, FP4 step or None): Qwen3, gpt-oss, DeepSeek-V3 (its 2048);
# FP4 steps of 256 over a ragged I (FP4_RAGGED_STEP: gpt-oss's 2880, and 320)
H_CASES = [(768, "concatenated", "silu", None, 256), (768, "concatenated", "silu", None, None),
           (2880, "interleaved", "gpt_oss", 7.0, 192), (2880, "interleaved", "gpt_oss", 7.0, None),
           (2048, "concatenated", "silu", None, 256), (2880, "interleaved", "gpt_oss", 7.0, 256),
           (320, "concatenated", "silu", None, 256)]


@pytest.mark.parametrize("inter,layout,activation,limit,block_k", H_CASES)
@pytest.mark.parametrize("keep,roll", [(16, 6), (4, 6), (4, 5), (2, 1)])
@pytest.mark.parametrize("program_rows,splits", [(1, 1), (1, 3), (2, 2), (4, 1)])
def test_h_program_inline(emulated, monkeypatch, inter, layout, activation, limit, block_k,
                          keep, roll, program_rows, splits):
    """An h program of the one launch: its rows' ``act(gate) * up`` (K-split partials summed),
    rounded to bf16, scaled into f16 by a power of two, in the FP4 operand column order where
    ``block_k`` is given, and the factor; the chunks kept in registers or recomputed in rolled
    loops of ``H_ROLL`` (``H_KEEP_CHUNKS``; a last iteration's chunks past the row masked);
    rows past ``count`` and other rows untouched; over a ragged I the rows ``row_width``
    wide, zeros past I. Against ``rows.h_rows``' math (the emulator's ``exp`` is numpy's:
    values within a bf16 rounding, factors exact)."""
    from pallas_kernels.grouped_matmul.config import Activation, GateUpLayout
    from tests.mgpu_emulator import Memory

    monkeypatch.setattr(mosaic, "H_KEEP_CHUNKS", keep)
    monkeypatch.setattr(mosaic, "H_ROLL", roll)
    monkeypatch.setattr(mosaic, "H_PROGRAM_ROWS", program_rows)
    rng = np.random.default_rng(inter + keep + roll + program_rows)
    rows = 11
    gu = rng.normal(0, 2, (splits * rows, 2 * inter)).astype(np.float32)
    gu[: rows, 3] = 40.0  # a gate (or up) past gpt-oss's limit
    gu[[s * rows + 5 for s in range(splits)]] = 0.0  # a row of zeros (the factor's floor)
    layout, activation = GateUpLayout(layout), Activation(activation)
    for first, count in [(0, program_rows), (5, max(program_rows - 1, 1)), (rows - 1, 1)]:
        poison_h = np.full((rows, row_width(inter, block_k)), np.nan, np.float16)
        h, hf = Memory(poison_h), Memory(np.full(rows, -1.0, np.float32))
        red = Memory(np.zeros(4, np.float32))
        mosaic._h_program_inline(Memory(gu), h, hf, first, count, red, splits=splits,
                                 rows=rows, layout=layout, activation=activation, limit=limit,
                                 alpha=mosaic.GPT_OSS_ALPHA, block_k=block_k)
        want_h, want_f = _h_reference(gu, rows, first, count, splits, layout, activation,
                                      limit, block_k)
        got_h, got_f = h.array(), hf.array()
        np.testing.assert_array_equal(got_f[first:first + count], want_f)
        got = got_h[first:first + count].astype(np.float32)
        want = want_h.astype(np.float32)
        scale = np.abs(want).max(axis=1, keepdims=True)
        bad = np.abs(got - want) > scale * 2.0**-7
        assert not bad.any(), f"{bad.sum()} values off (rows {first}+{count})"
        outside = np.ones(rows, bool)
        outside[first:first + count] = False
        assert np.isnan(got_h[outside]).all() and (got_f[outside] == -1.0).all()


def test_window_factors_and_row_bias_inline(emulated):
    """The epilogue's loads: a window's row factors (each thread its two columns by one 8-byte
    load) and the rows' bias from the flat table (bf16, f16, f32)."""
    rng = np.random.default_rng(5)
    factors = rng.normal(size=40).astype(np.float32)
    for row0, wn in [(0, 8), (16, 16), (24, 16), (8, 24)]:
        got = wgmma_matrix(mosaic._window_factors_inline(factors, row0, wn), wn)
        np.testing.assert_array_equal(got, np.broadcast_to(factors[row0:row0 + wn],
                                                           (BLOCK_N, wn)))
    for dtype in (ml_dtypes.bfloat16, np.float16, np.float32):
        bias = rng.normal(size=4 * N).astype(dtype)
        for first in (0, N + BLOCK_N, 3 * N):
            got = row_values(mosaic._row_bias_inline(bias, first)).view(np.float32)
            np.testing.assert_array_equal(got, bias[first:first + BLOCK_N].astype(np.float32))


@pytest.mark.parametrize("inter,layout,activation,limit,block_k,bk,kcols,k0,wn", [
    (768, "concatenated", "silu", None, 256, 256, 768, 0, 8),  # Qwen3 FP4, one split
    (768, "concatenated", "silu", None, 256, 256, 256, 512, 8),  # its last of three splits
    (768, "concatenated", "silu", None, None, 128, 384, 384, 16),  # FP8, windows of 16
    (2880, "interleaved", "gpt_oss", 7.0, 192, 192, 960, 960, 8),  # gpt-oss FP4, split 2 of 3
    (2880, "interleaved", "gpt_oss", 7.0, 320, 320, 2880, 0, 8),  # steps of 320, one split
    (2880, "interleaved", "gpt_oss", 7.0, 256, 256, 1536, 1536, 8),  # ragged 256: split 2 of 2
    (320, "concatenated", "silu", None, 256, 256, 512, 0, 8)])  # ragged, one split
@pytest.mark.parametrize("splits", [1, 2])
def test_h_tile_inline(emulated, inter, layout, activation, limit, block_k, bk, kcols, k0, wn,
                       splits):
    """The own-h down launch (``DOWN_MAKES_H_TOKENS``): a down program's h for its K steps,
    one row of its item at a time by all 128 threads, into the SMEM tile ``[steps, wn, bk]``
    in the wgmma B layout (8-row, 64-column tiles, 128-byte swizzle) at the row's window
    slot, scaled against those columns' max, the factor at the slot; the window's other rows
    untouched. Against ``rows.h_rows``'
    math on the columns ``[k0, k0 + kcols)`` (within a bf16 rounding; factors exact)."""
    from pallas_kernels.grouped_matmul.config import Activation, GateUpLayout
    from tests.mgpu_emulator import smem_offsets

    rng = np.random.default_rng(inter + kcols + k0 + splits)
    rows, row0 = 40, 16
    gu = rng.normal(0, 2, (splits * rows, 2 * inter)).astype(np.float32)
    layout, activation = GateUpLayout(layout), Activation(activation)
    steps = kcols // bk
    tile = Memory(np.full(steps * wn * bk, np.nan, np.float16))
    factors = Memory(np.full(wn, -1.0, np.float32))
    red = Memory(np.zeros(4, np.float32))
    first, count = row0 + 3, 4  # slots 3-6 of the window
    for i in range(count):
        mosaic._h_program_inline(Memory(gu), tile, factors, first + i, 1, red, splits=splits,
                                 rows=rows, layout=layout, activation=activation, limit=limit,
                                 alpha=mosaic.GPT_OSS_ALPHA, block_k=block_k,
                                 tile=(first - row0 + i, k0, kcols, wn, bk))
    # the tile's logical [steps, wn, bk] from its bytes
    at = smem_offsets(wn, 2 * bk, 128)
    raw = tile.bytes.reshape(steps, -1)
    got = np.stack([raw[s][at].reshape(wn, bk, 2) for s in range(steps)]).view(np.float16)
    got = got.reshape(steps, wn, bk).transpose(1, 0, 2).reshape(wn, kcols)
    want, want_f = _h_reference(gu, rows, first, count, splits, layout, activation, limit,
                                block_k, cols=slice(k0, k0 + kcols))
    slots = slice(first - row0, first - row0 + count)
    np.testing.assert_array_equal(factors.array()[slots], want_f)
    scale = np.abs(want.astype(np.float32)).max(axis=1, keepdims=True)
    bad = np.abs(got[slots].astype(np.float32) - want.astype(np.float32)) > scale * 2.0**-7
    assert not bad.any(), f"{bad.sum()} values off"
    others = np.ones(wn, bool)
    others[slots] = False
    assert np.isnan(got[others]).all() and (factors.array()[others] == -1.0).all()
