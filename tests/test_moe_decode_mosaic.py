"""Tests of the Mosaic GPU MoE decode kernels (``pallas_kernels.moe_decode.mosaic``) and of
``KernelConfig.decode_kernel``.

On CPU the kernels run in the Mosaic GPU interpreter, which fills outputs with NaN first: rows
no work item owns must stay NaN, every owned row must be written. The interpreter's wgmma reads
its A operand from SMEM only, so there the converted weight tile is staged through SMEM (the
compiled kernel keeps it in registers; ``TestLowersForHopper`` lowers that build for sm_90
without a GPU, the GPU class runs it). Shapes: H = 192 (64-wide K steps: not a multiple of
128), I = 128, FP8 blocks of 64 x 128 (a scale per 64-row tile, a partial block along H).
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import export

import atlas_jax as aj
from atlas_jax.config import ActQuant, Format
from pallas_kernels.grouped_matmul.config import Activation, GateUpLayout, WeightFormat
from pallas_kernels.moe_decode import ExtraExperts, make_plan, moe_decode_pairs_reference, mosaic
from pallas_kernels.moe_decode.kernel import RADIX_PLAN_MAX_PAIRS, item_count, item_span, num_items
from pallas_kernels.moe_decode.mosaic import (
    ROWS,
    HSource,
    SlotTile,
    _natural_order,
    choose_item_rows,
    choose_k_splits,
    choose_slot_tile,
    format_name,
    fp4_operand_order,
    moe_decode_mosaic_pairs,
    num_k_steps,
    permute_fp4_activations,
    slot_matmul,
    slot_matmul_reference,
    slot_mlp,
    window,
    window_rows,
    work_items,
)
from pallas_kernels.moe_decode.rows import row_width
from tests.test_moe import make
from tests.test_moe_decode_kernel import far_apart_case, make_weights, rel_err, routing

ops_decode = importlib.import_module("atlas_jax.ops.moe_decode")  # the module, not the function
E, H, I = 6, 192, 128
FP8_BLOCK = (64, 128)
ON_GPU = jax.devices()[0].platform == "gpu"
FP8, BF16, NVFP4, MXFP4 = (WeightFormat.FP8_BLOCK, WeightFormat.BF16, WeightFormat.NVFP4,
                           WeightFormat.MXFP4)
FP4 = (NVFP4, MXFP4)


def arrays(fmt: WeightFormat, *, e: int = E, h: int = H, inter: int = I, bias: bool = False,
           seed: int = 0, fp8_block: tuple[int, int] = FP8_BLOCK) -> dict:
    """Keyword arrays of both stacks for ``moe_decode_mosaic_pairs`` and the reference (NVFP4:
    gate_up with two global-scale row segments)."""
    rng = np.random.default_rng(seed)
    gu = make_weights(rng, fmt, 2 * inter, h, e=e, fp8_block=fp8_block, global_rows=2)
    dn = make_weights(rng, fmt, h, inter, e=e, fp8_block=fp8_block)
    kw = dict(gate_up=gu.pop("w"), down=dn.pop("w"), fmt=fmt)
    kw.update({f"gate_up_{name}": v for name, v in gu.items()})
    kw.update({f"down_{name}": v for name, v in dn.items()})
    if fmt is FP8:
        kw["block_size"] = fp8_block
    if bias:
        kw.update(gate_up_bias=jnp.asarray(
                      (0.5 * rng.standard_normal((e, 2 * inter))).astype(ml_dtypes.bfloat16)),
                  down_bias=jnp.asarray(0.5 * rng.standard_normal((e, h)), jnp.float32))
    return kw


@contextlib.contextmanager
def mosaic_constants(monkeypatch, **values):
    """``pallas_kernels.moe_decode.mosaic``'s constants set for the block; jit's caches are
    cleared on the way in and out (the kernels' traces read the constants)."""
    for name, value in values.items():
        monkeypatch.setattr(mosaic, name, value)
    jax.clear_caches()
    try:
        yield
    finally:
        jax.clear_caches()


def x_rows(t: int, seed: int = 7) -> jax.Array:
    """[T, H] bf16 rows of magnitudes 1e-2 .. 3e2 (the per-row f16 scaling)."""
    rng = np.random.default_rng(seed)
    scale = np.logspace(-2, 2.5, t)[:, None] if t > 1 else 1.0
    return jnp.asarray((rng.standard_normal((t, H)) * scale).astype(ml_dtypes.bfloat16))


def assert_pairs_close(out, ref, ids, num_experts: int, tol: float = 2e-3):
    """Every routed pair finite and close to the reference on its own; zero experts 0."""
    chex.assert_equal_shape([out, ref])
    chex.assert_type(out, jnp.float32)
    out, ref, ids = np.asarray(out), np.asarray(ref), np.asarray(ids)
    assert np.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite pair output"
    for i, j in np.ndindex(ids.shape):
        if not 0 <= ids[i, j] < num_experts:
            np.testing.assert_array_equal(out[i, j], 0.0)
            continue
        # both sides round h to bf16: a rare 1-ulp flip moves a row by ~2^-8 of one term
        assert rel_err(out[i, j], ref[i, j]) < tol, (i, j, rel_err(out[i, j], ref[i, j]))


# ---------------------------------------------------------------------------------------------
# The launch: work items over sorted rows.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [FP8, BF16, NVFP4, MXFP4], ids=lambda f: f.value)
@pytest.mark.parametrize("k,k_splits", [(128, 1), (192, 1), (192, 3)])  # one 128-wide step;
#   three 64-wide steps, in one program or three
def test_slot_matmul_writes_exactly_its_rows(fmt, k, k_splits):
    """Items start at rows that are not multiples of 8 (windows read rows of their
    neighbours), hold 1..16 rows (every set bit of the store), two column tiles (NVFP4: each
    with its own global scale); an unused item and rows no item owns: those rows stay NaN.
    K split over programs: each split's scales (FP8 blocks, FP4 groups) at its own steps."""
    check_slot_matmul(fmt, k, compiled=False, k_splits=k_splits)


@pytest.mark.parametrize("fmt", [FP8, NVFP4, MXFP4], ids=lambda f: f.value)
@pytest.mark.parametrize("prefetch", [1, 5])  # the step before; further than the 3 steps
def test_slot_matmul_scale_prefetch(fmt, prefetch, monkeypatch):
    """Scales loaded 1 step ahead and more steps ahead than the program has (the queue clamped
    to the last step): each step still gets its own scales."""
    with mosaic_constants(monkeypatch, SCALE_PREFETCH=prefetch):
        check_slot_matmul(fmt, 384, compiled=False)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled Mosaic GPU kernels")
@pytest.mark.parametrize("fmt", [FP8, BF16, NVFP4, MXFP4], ids=lambda f: f.value)
@pytest.mark.parametrize("k,k_splits", [(128, 1), (192, 1), (384, 1), (320, 1), (384, 3),
                                        (320, 5)])  # K steps: 1 x 128, 3 x 64, 3 x 128, 5 x 64
def test_compiled_slot_matmul_on_gpu(fmt, k, k_splits):
    """The same items through the compiled kernels (operands in registers)."""
    check_slot_matmul(fmt, k, compiled=True, k_splits=k_splits)


WIDE_FP4_CASES = [(256, 256, 1), (256, 768, 1), (256, 768, 3),  # (block_k, K, k_splits)
                  (192, 192, 1), (192, 576, 1), (192, 576, 3), (192, 960, 5),
                  (320, 320, 1), (320, 960, 1), (320, 960, 3)]


def check_h_source(fmt, k, *, compiled: bool, k_splits: int, gu_splits: int,
                   item_rows: int, gpt_oss: bool = False, block_k: int | None = None):
    """``slot_matmul(h_source=)`` (each program makes its window's h from the gate_up output)
    against ``rows.h_rows`` then ``slot_matmul`` on its rows and factors."""
    from pallas_kernels.moe_decode.rows import h_rows

    rng = np.random.default_rng(11)
    n = 128
    w = make_weights(rng, fmt, n, k, e=4, fp8_block=FP8_BLOCK, global_rows=2)
    scale, global_scale = w.get("scale"), w.get("global_scale")
    name = format_name(fmt, w["w"].dtype)
    work, p = slot_items(item_rows)
    rows = window_rows(p, item_rows)
    gu = jnp.asarray(rng.normal(0, 2, (gu_splits * rows, 2 * k)), jnp.float32)
    act, layout, limit = ((Activation.GPT_OSS, GateUpLayout.INTERLEAVED, 7.0) if gpt_oss
                          else (Activation.SILU, GateUpLayout.CONCATENATED, None))
    tile = choose_slot_tile(k, fmt=name, rows=item_rows) if block_k is None else SlotTile(
        block_k=block_k, num_stages=mosaic.NUM_STAGES_WIDE, rows=item_rows)
    fp4 = fmt in FP4
    kw = dict(fmt=name, fp8_block=FP8_BLOCK if fmt is FP8 else None, tile=tile,
              k_splits=k_splits)
    h, hf = h_rows(gu, splits=gu_splits, activation=act, layout=layout, limit=limit,
                   block_k=tile.block_k if fp4 else None, interpret=True)
    ref = slot_matmul(work, h, w["w"], scale, None, global_scale, row_factor=hf,
                      interpret=True, **kw)
    out = slot_matmul(work, gu, w["w"], scale, None, global_scale, h_source=HSource(
        gu_splits, act, layout, limit, mosaic.GPT_OSS_ALPHA), interpret=not compiled, **kw)
    owned = owned_rows(work, rows)
    out, ref = np.asarray(out), np.asarray(ref)
    np.testing.assert_allclose(out[owned], ref[owned], rtol=1e-5,
                               atol=1e-5 * np.abs(ref[owned]).max())


@pytest.mark.parametrize("fmt,k,k_splits,gu_splits,item_rows,gpt_oss", [
    (NVFP4, 512, 1, 1, 8, False), (NVFP4, 768, 3, 2, 1, False), (MXFP4, 768, 1, 3, 8, True),
    (MXFP4, 576, 3, 1, 16, True), (FP8, 384, 3, 2, 8, False), (FP8, 256, 1, 1, 1, True)],
    ids=str)
def test_slot_matmul_h_source(monkeypatch, fmt, k, k_splits, gu_splits, item_rows, gpt_oss):
    """The own-h down launch (``DOWN_MAKES_H_TOKENS``): the programs' own h (per K split,
    scaled against its columns' max) give the outputs of the h launch's rows, for FP8 and FP4
    (operand order), SiLU / gpt-oss, gate_up and down K splits, items of 1, 8 and 16 rows."""
    check_h_source(fmt, k, compiled=False, k_splits=k_splits, gu_splits=gu_splits,
                   item_rows=item_rows, gpt_oss=gpt_oss)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled Mosaic GPU kernels")
@pytest.mark.parametrize("fmt,k,k_splits,gu_splits,item_rows,gpt_oss", [
    (NVFP4, 768, 3, 2, 8, False), (NVFP4, 768, 1, 1, 1, False), (MXFP4, 2880, 3, 3, 8, True),
    (MXFP4, 2880, 1, 1, 8, True), (FP8, 768, 2, 2, 16, False), (FP8, 384, 1, 1, 1, True)],
    ids=str)
def test_compiled_slot_matmul_h_source(fmt, k, k_splits, gu_splits, item_rows, gpt_oss):
    """The compiled own-h down launch: each program's h rows into its SMEM tile
    (the wgmma B layout), kept or (gpt-oss, one split: 12 chunks a thread) rolled, the
    pipeline on the weights alone, the factors from SMEM."""
    check_h_source(fmt, k, compiled=True, k_splits=k_splits, gu_splits=gu_splits,
                   item_rows=item_rows, gpt_oss=gpt_oss)


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda f: f.value)
@pytest.mark.parametrize("block_k,k,k_splits", WIDE_FP4_CASES)
def test_slot_matmul_wide_fp4_steps(fmt, block_k, k, k_splits):
    """NVFP4 and MXFP4 in K steps of 256 (a thread's 64 columns: four NVFP4 groups, two MXFP4
    ones; MXFP4's factors against the max of eight scales) and 192 (gpt-oss's K = 2880 is 15
    of them: a thread's 48 columns are three NVFP4 groups, 3 bytes at 3 x its lane, or span
    two E8M0 groups, in a different place for each thread of a quad; MXFP4 rows of K / 32 = 6,
    18 and 30 scale bytes, 2-byte loads) and 320 (``FP4_STEPS``; a thread's 80 columns are
    five NVFP4 groups or span three E8M0 ones), in one program or one a step."""
    check_slot_matmul(fmt, k, compiled=False, k_splits=k_splits, block_k=block_k)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled Mosaic GPU kernels")
@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda f: f.value)
@pytest.mark.parametrize("block_k,k,k_splits", WIDE_FP4_CASES + [
    (256, 2048, 2), (192, 2880, 1), (192, 2880, 3), (320, 2880, 3)])
def test_compiled_slot_matmul_wide_fp4_steps(fmt, block_k, k, k_splits):
    """The compiled wide FP4 steps: at 256 two 16-byte code loads a row, four factor slots,
    two scale words for MXFP4; at 192 96-byte code rows in tiles of the 32-byte swizzle,
    three 8-byte loads a row; at 320 160-byte rows, five parts of one 8-byte load a row."""
    check_slot_matmul(fmt, k, compiled=True, k_splits=k_splits, block_k=block_k)


# (block_k, K, k_splits): steps of 128 and 64 (a thread's columns in one E8M0 group, or half
# of one), then the wide steps
MX_CASES = [(128, 384, 1), (128, 384, 3), (64, 320, 5)] + WIDE_FP4_CASES


@pytest.mark.parametrize("block_k,k,k_splits", MX_CASES)
def test_slot_matmul_mx_row_max(block_k, k, k_splits):
    """MXFP4: each row's factors against its largest scale over the program's K steps (a K
    split: its own steps', from its first group), one accumulator, the row's ``2^(s_max - 127
    + 6)`` at the end; with the epilogue's row factors and bias."""
    check_slot_matmul(MXFP4, k, compiled=False, k_splits=k_splits, block_k=block_k,
                      bias_dtype=jnp.float32 if k_splits == 1 else None)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled Mosaic GPU kernels")
@pytest.mark.parametrize("item_rows", [8, 16])
@pytest.mark.parametrize("block_k,k,k_splits", MX_CASES + [
    (256, 2048, 2), (192, 2880, 1), (192, 2880, 3)])
def test_compiled_slot_matmul_mx_row_max(block_k, k, k_splits, item_rows):
    """The compiled row-max pre-pass (a quad's threads each every fourth load of the program's
    scale bytes, two shuffles; 8-byte loads, or 2-byte ones for gpt-oss's 90-byte rows) and
    each thread's own scale bytes a step (one 2-byte load at steps of 256, bytes at 192 where
    a quad's threads start in different groups)."""
    check_slot_matmul(MXFP4, k, compiled=True, k_splits=k_splits, block_k=block_k,
                      item_rows=item_rows, bias_dtype=jnp.float32 if k_splits == 1 else None)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled Mosaic GPU kernels")
@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda f: f.value)
@pytest.mark.parametrize("parts", [1, 2, 4])
@pytest.mark.parametrize("item_rows,k,k_splits", [(8, 768, 1), (16, 2048, 2), (1, 512, 1)])
def test_compiled_fp4_parts(monkeypatch, fmt, parts, item_rows, k, k_splits):
    """A compiled FP4 K step of 256 dotted as one wgmma, two of 128 or four of 64 (a thread's
    8-byte code loads, each part's activation columns), at windows of 8 and 16 rows."""
    with mosaic_constants(monkeypatch, FP4_PARTS=parts):
        check_slot_matmul(fmt, k, compiled=True, k_splits=k_splits, block_k=256,
                          item_rows=item_rows, bias_dtype=jnp.float32)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled Mosaic GPU kernels")
@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda f: f.value)
@pytest.mark.parametrize("item_rows,k,k_splits", [(8, 960, 1), (16, 2880, 3), (1, 576, 1)])
def test_compiled_fp4_parts_192(monkeypatch, fmt, item_rows, k, k_splits):
    """A compiled FP4 K step of 192 dotted as three wgmmas of 64 (``FP4_PARTS_192``: one
    8-byte code load a row a part; MXFP4's 32-column groups span two parts)."""
    with mosaic_constants(monkeypatch, FP4_PARTS_192=3):
        check_slot_matmul(fmt, k, compiled=True, k_splits=k_splits, block_k=192,
                          item_rows=item_rows, bias_dtype=jnp.float32)


@pytest.mark.parametrize("fmt", [FP8, BF16], ids=lambda f: f.value)
@pytest.mark.parametrize("k,k_splits", [(192, 1), (192, 2), (320, 3)])  # 128 + 64; 2 x 128 + 64
def test_slot_matmul_ragged_k(fmt, k, k_splits):
    """FP8 and BF16 in K steps of 128 where 128 does not divide K: the last step half past K
    (the interpreter pads K with zeros, as the TMA fills them), alone or in its own split."""
    check_slot_matmul(fmt, k, compiled=False, k_splits=k_splits, block_k=128)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled Mosaic GPU kernels")
@pytest.mark.parametrize("fmt", [FP8, BF16], ids=lambda f: f.value)
@pytest.mark.parametrize("k,k_splits,stages", [(192, 1, 3), (192, 2, 3), (320, 3, 3),
                                               (2880, 1, 3), (2880, 1, 4)])
def test_compiled_slot_matmul_ragged_k(fmt, k, k_splits, stages):
    """The ragged last step through the compiled kernels: the TMA's zero fill past K (gpt-oss's
    2880 also at its 4 stages)."""
    check_slot_matmul(fmt, k, compiled=True, k_splits=k_splits, block_k=128,
                      num_stages=stages)


@pytest.mark.parametrize("fmt", [FP8, BF16, NVFP4, MXFP4], ids=lambda f: f.value)
@pytest.mark.parametrize("k,k_splits,bias_dtype", [(128, 1, jnp.bfloat16), (384, 3, jnp.float32),
                                                   (384, 1, jnp.float16)])
def test_slot_matmul_epilogue(fmt, k, k_splits, bias_dtype):
    """The epilogue: each row times its own factor (powers of two from 2^-20 to 2^7, every
    window column a different one), the item's expert's bias row added once (in split 0)."""
    check_slot_matmul(fmt, k, compiled=False, k_splits=k_splits, bias_dtype=bias_dtype)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled Mosaic GPU kernels")
@pytest.mark.parametrize("fmt", [FP8, BF16, NVFP4, MXFP4], ids=lambda f: f.value)
@pytest.mark.parametrize("k,k_splits,bias_dtype", [(128, 1, jnp.bfloat16), (384, 3, jnp.float32),
                                                   (384, 1, jnp.float16)])
def test_compiled_slot_matmul_epilogue(fmt, k, k_splits, bias_dtype):
    """The compiled epilogue: factors by 8-byte loads a thread's column pair, the bias a row."""
    check_slot_matmul(fmt, k, compiled=True, k_splits=k_splits, bias_dtype=bias_dtype)


@pytest.mark.parametrize("compiled", [
    False, pytest.param(True, marks=pytest.mark.skipif(
        not ON_GPU, reason="needs a GPU: runs the compiled Mosaic GPU kernels"))],
    ids=["interpret", "compiled"])
@pytest.mark.parametrize("fmt,item_rows", [(FP8, 16), (MXFP4, 8), (NVFP4, 1), (BF16, 16)],
                         ids=str)
def test_slot_matmul_epilogue_loads_after_steps(monkeypatch, compiled, fmt, item_rows):
    """The epilogue's row factors and bias loaded after the K steps (``EPILOGUE_LOADS_AHEAD``
    False: fewer registers held through the loop) give the same rows, K split included."""
    with mosaic_constants(monkeypatch, EPILOGUE_LOADS_AHEAD=False):
        check_slot_matmul(fmt, 512, compiled=compiled, k_splits=2, item_rows=item_rows,
                          bias_dtype=jnp.bfloat16)


SMALL_WINDOW_CASES = [(1, FP8, 256, 1), (8, FP8, 128, 1), (9, BF16, 256, 2), (1, NVFP4, 512, 1),
                      (8, MXFP4, 512, 2), (3, NVFP4, 384, 1), (8, BF16, 128, 1),
                      (13, FP8, 256, 1)]


@pytest.mark.parametrize("item_rows,fmt,k,k_splits", SMALL_WINDOW_CASES, ids=str)
def test_slot_matmul_small_windows(item_rows, fmt, k, k_splits):
    """Items of at most 1 / 3 / 8 (aligned) / 9 / 13 rows (``SlotTile.rows``) in windows of 8 /
    16 / 8 / 16 / 24 rows (the wgmma's N), the epilogue's factors and bias in; each set bit of
    a row count one store."""
    check_slot_matmul(fmt, k, compiled=False, k_splits=k_splits, item_rows=item_rows,
                      bias_dtype=jnp.float32)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled Mosaic GPU kernels")
@pytest.mark.parametrize("item_rows,fmt,k,k_splits", SMALL_WINDOW_CASES, ids=str)
def test_compiled_slot_matmul_small_windows(item_rows, fmt, k, k_splits):
    """The compiled small windows: wgmma N of 8 and 16, the factors' loads a window."""
    check_slot_matmul(fmt, k, compiled=True, k_splits=k_splits, item_rows=item_rows,
                      bias_dtype=jnp.float32)


def test_item_rows_and_windows(monkeypatch):
    """Items of 1 row at 1 token, aligned items of 8 rows at 2-8 tokens, past 8 items of 8
    where the experts have few rows each, else 16 (BF16: 16 from 2); blocks of 8 in FP4 steps
    of 17-32 tokens with few rows an expert (``blocked_items``); read in windows of 8 (1 and 8
    rows), 16 (2-7, 9, 16 rows), 24 (10-15) from an 8-aligned row; a ``SlotTile``'s rows in
    [1, 16]."""
    assert [choose_item_rows(t) for t in (1, 2, 3, 8, 9, 16, 64)] == [1, 8, 8, 8, 16, 16, 16]
    assert [choose_item_rows(t, "bf16") for t in (1, 2, 8, 9)] == [1, 16, 16, 16]
    assert choose_item_rows(3, "nvfp4") == 8
    # past 8 tokens, items of 8 where the experts have at most SMALL_ITEM_DENSITY rows each
    # (and blocks of 8 at 32 tokens, below)
    assert [choose_item_rows(t, "nvfp4", t * 8 / 128) for t in (16, 24, 32, 64)] == [8, 8, 8,
                                                                                     16]
    assert [choose_item_rows(t, "fp8", t * 8 / 128) for t in (16, 24, 32, 64)] == [8, 8, 16,
                                                                                   16]
    assert choose_item_rows(16, "bf16", 1.0) == 16 and choose_item_rows(16, "fp8", 2.0) == 16
    # blocks: FP4 at 17-32 tokens with at most 2 rows an expert (Qwen3's 128 experts, top-8)
    assert [mosaic.blocked_items(t, f, t * 8 / 128) for f in ("nvfp4", "mxfp4")
            for t in (16, 17, 32, 33)] == [False, True, True, False] * 2
    assert not any(mosaic.blocked_items(24, f, 1.5) for f in ("bf16", "fp8"))
    assert not mosaic.blocked_items(32, "nvfp4", 2.5)  # Mixtral-like: experts of many rows
    assert [choose_item_rows(32, f, 2.0) for f in ("nvfp4", "mxfp4", "fp8")] == [8, 8, 16]
    assert choose_item_rows(32, "nvfp4", 2.5) == 16
    monkeypatch.setattr(mosaic, "BLOCKED_ITEM_TOKENS", (9, 32))
    monkeypatch.setattr(mosaic, "BLOCKED_FORMATS", ("fp8", "nvfp4"))
    monkeypatch.setattr(mosaic, "BLOCKED_MAX_DENSITY", 4.0)
    assert [choose_item_rows(t, "fp8", 4.0) for t in (8, 9, 32, 33)] == [8, 8, 8, 16]
    assert not mosaic.blocked_items(16, "bf16", 1.0)
    assert [window(r) for r in (1, 2, 7, 8, 9, 10, 15, 16)] == [8, 16, 16, 8, 16, 24, 24, 16]
    assert SlotTile(rows=3).window == 16 and SlotTile().window == 16
    assert window_rows(45, 1) == 48 and window_rows(45) == 56 and window_rows(45, 8) == 48
    assert choose_slot_tile(768, fmt="fp8", rows=2).rows == 2
    for bad in (0, 17, 2.0):
        with pytest.raises(ValueError, match="SlotTile.rows: expected an int in"):
            SlotTile(rows=bad)


def slot_items(item_rows: int) -> tuple[jax.Array, int]:
    """(work ``[3, W]``, P = 45 routed rows) of 4 experts: (expert, first row, rows) = rows
    0-15, 16 (1 row), 19-31 (13), 33-39 (7), 42-44 (3), each cut into items of at most
    ``item_rows`` rows (kernel.cut_base: aligned for multiples of 8), and an unused item."""
    work = [(4, 0, 0)]
    for e, r0, count in [(2, 0, 16), (0, 16, 1), (3, 19, 13), (1, 33, 7), (2, 42, 3)]:
        for c in range(int(item_count(r0, count, item_rows))):
            start, end = (int(v) for v in item_span(r0, count, c, item_rows))
            work.append((e, start, end - start))
    return jnp.asarray(np.array(work).T, jnp.int32), 45


def owned_rows(work, rows: int) -> np.ndarray:
    """``[rows]`` bool: the rows some item owns."""
    owned = np.zeros(rows, bool)
    for _, first, count in np.asarray(work).T:
        owned[first:first + count] = True
    return owned


def check_slot_matmul(fmt, k, *, compiled: bool, k_splits: int = 1, block_k: int | None = None,
                      bias_dtype=None, num_stages: int | None = None, item_rows: int = ROWS):
    rng = np.random.default_rng(3)
    n = 128  # two 64-row column tiles
    fp8_block = FP8_BLOCK
    w = make_weights(rng, fmt, n, k, e=4, fp8_block=fp8_block, global_rows=2)
    scale, global_scale = w.get("scale"), w.get("global_scale")
    name = format_name(fmt, w["w"].dtype)
    work, p = slot_items(item_rows)
    a_dtype = jnp.bfloat16 if fmt is BF16 else jnp.float16
    rows = window_rows(p, item_rows)
    a = jnp.asarray(rng.standard_normal((rows, k)), a_dtype)
    tile = choose_slot_tile(k, num_stages, rows=item_rows) if block_k is None else SlotTile(
        block_k=block_k, num_stages=num_stages or mosaic.NUM_STAGES, rows=item_rows)
    a_kernel = permute_fp4_activations(a, tile) if fmt in FP4 else a
    fp8_block = fp8_block if fmt is FP8 else None
    epilogue = {}
    if bias_dtype is not None:
        epilogue = dict(
            row_factor=jnp.asarray(2.0 ** rng.integers(-20, 8, rows), jnp.float32),
            bias=jnp.asarray(rng.standard_normal((4, n)), bias_dtype))
    out = slot_matmul(work, a_kernel, w["w"], scale, None, global_scale, fmt=name,
                      fp8_block=fp8_block, tile=tile, k_splits=k_splits,
                      interpret=not compiled, **epilogue)
    ref = slot_matmul_reference(work, a, w["w"], scale, global_scale, fmt=name,
                                fp8_block=fp8_block, **epilogue)
    chex.assert_shape(out, (rows, n))
    out, ref = np.asarray(out), np.asarray(ref)
    owned = owned_rows(work, rows)
    if not compiled:  # the interpreter's outputs start NaN
        assert np.isnan(out[~owned]).all(), "a row no item owns was written"
    np.testing.assert_allclose(out[owned], ref[owned], rtol=1e-5,
                               atol=1e-5 * np.abs(ref).max())


# FP4 over a ragged K in steps of 256 (FP4_RAGGED_STEP): K of 320 (256 + 64), 576 (2 x 256 +
# 64) and 704 (2 x 256 + 192), alone or with K split (the last split's steps ragged)
RAGGED_FP4_CASES = [(320, 1), (576, 1), (576, 3), (704, 3)]


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda f: f.value)
@pytest.mark.parametrize("k,k_splits", RAGGED_FP4_CASES)
def test_slot_matmul_fp4_ragged_k(fmt, k, k_splits):
    """FP4 in K steps of 256 over a K that 256 does not divide: the last step's codes,
    scales (interpreter: zero-padded, as the TMA fills the codes and the compiled loads stay
    on the row's bytes) and activations (``permute_fp4_activations`` pads them) past K;
    against the reference, with the epilogue."""
    check_slot_matmul(fmt, k, compiled=False, k_splits=k_splits, block_k=256,
                      bias_dtype=jnp.float32)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled Mosaic GPU kernels")
@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda f: f.value)
@pytest.mark.parametrize("k,k_splits", RAGGED_FP4_CASES + [(2880, 1), (2880, 3)])
@pytest.mark.parametrize("item_rows", [1, 8, 16])
def test_compiled_slot_matmul_fp4_ragged_k(fmt, k, k_splits, item_rows):
    """The compiled ragged FP4 step: code tiles in the 32-byte swizzle, the last step's TMA
    zero fill past K, its scale loads clamped to the row's bytes (the last expert's last row
    too), the MXFP4 pre-pass's likewise; gpt-oss's K of 2880 in 12 steps."""
    check_slot_matmul(fmt, k, compiled=True, k_splits=k_splits, block_k=256,
                      item_rows=item_rows, bias_dtype=jnp.float32)


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda f: f.value)
def test_pairs_fp4_ragged_step(monkeypatch, fmt):
    """``FP4_RAGGED_STEP`` through the decode step (``FP4_STEPS`` 256 only, so that H takes it
    too): H = 192 and I = 320 in steps of 256 (one ragged step; two, the last ragged), x's and
    h's rows padded to whole steps (``rows.row_width``; the one launch's h program writes zeros
    past I), at 1 and 3 tokens (three launches) and 12 (both), gpt-oss's activation with biases.
    Each equals the reference."""
    kw = arrays(fmt, inter=320, bias=True)
    variant = dict(activation="gpt_oss", gate_up_layout="interleaved", limit=3.0)
    with mosaic_constants(monkeypatch, FP4_STEPS=(256,), FP4_RAGGED_STEP=256):
        name = format_name(fmt, None)
        assert choose_slot_tile(H, fmt=name).block_k == 256
        for t, fused in ((1, None), (3, None), (12, False), (12, None)):
            x, ids = x_rows(t), routing("random", t, 3, seed=t)
            out = moe_decode_mosaic_pairs(x, ids, interpret=True, fused=fused, **kw, **variant)
            ref = moe_decode_pairs_reference(x, ids, h_dtype=jnp.bfloat16, **kw, **variant)
            assert_pairs_close(out, ref, ids, E)


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda f: f.value)
def test_fp4_rows_and_scales_far_apart(fmt):
    """Rows spanning 1e-4 .. 1e4 (each scaled into f16 by its own power of two) and, for
    MXFP4, E8M0 scales spread over 2^-50 .. 2^10 within K steps (each step's factors are
    2^(s - s_max): its small blocks fall to f16 subnormals or 0, which must not show): every
    (token, slot) row matches the reference on its own."""
    x, ids, kw = far_apart_case(fmt, arrays(fmt))
    out = moe_decode_mosaic_pairs(x, ids, **kw, interpret=True)
    ref = moe_decode_pairs_reference(x, ids, h_dtype=jnp.bfloat16, **kw)
    assert_pairs_close(out, ref, ids, E, tol=5e-3)


@pytest.mark.parametrize("compiled", [
    False, pytest.param(True, marks=pytest.mark.skipif(
        not ON_GPU, reason="needs a GPU: runs the compiled Mosaic GPU kernels"))],
    ids=["interpret", "compiled"])
def test_mx_row_max_scales_far_apart(compiled):
    """MXFP4's row-max factors on the far-apart case (E8M0 scales over 2^-50 .. 2^10 within
    rows: blocks far below their row's largest fall to f16 subnormals or 0): every row still
    matches the reference on its own, in three launches and in one."""
    x, ids, kw = far_apart_case(MXFP4, arrays(MXFP4))
    ref = moe_decode_pairs_reference(x, ids, h_dtype=jnp.bfloat16, **kw)
    for fused in (False, True):
        out = moe_decode_mosaic_pairs(x, ids, **kw, fused=fused, interpret=not compiled)
        assert_pairs_close(out, ref, ids, E, tol=5e-3)


@pytest.mark.parametrize("pattern", ["random", "repeated", "one_expert", "zero_experts",
                                     "all_zero", "dup_in_token"])
@pytest.mark.parametrize("t,k,item_rows", [(1, 4, 16), (1, 4, 1), (8, 2, 16), (8, 2, 3),
                                           (8, 4, 8), (21, 6, 16), (21, 6, 8), (21, 6, 5),
                                           (64, 6, 16)])
def test_work_items_cut_each_slot_into_chunks(pattern, t, k, item_rows):
    """Items hold 1..item_rows rows of one expert, in order, covering every routed row once
    and no other row (repeated experts of a token, "dup_in_token", make runs longer than T:
    cut too), each inside its window (``start % 8 + rows <= window(item_rows)``; a slot cut
    only where it must be: ``kernel.cut_base``); items past the last are (E, routed rows, 0);
    the static bound ``num_items`` holds. The Pallas plan launches (a pairwise program up to
    32 pairs, then a radix-sort program) cut the same items as XLA's cut of the XLA plan."""
    ids = routing(pattern, t, k)
    plan = make_plan(ids, E)
    assert plan.items is None
    items = np.asarray(work_items(plan, E, item_rows))
    in_plan = make_plan(ids, E, pallas=True, interpret=True, item_rows=item_rows)
    assert (in_plan.items is None) == (t * k > RADIX_PLAN_MAX_PAIRS)
    np.testing.assert_array_equal(in_plan.work, plan.work)
    np.testing.assert_array_equal(work_items(in_plan, E, item_rows), items)
    expert, first, rows = np.asarray(plan.work)
    p = t * k
    chex.assert_shape(items, (3, num_items(min(E, p), p, item_rows)))
    ie, istart, icount = items
    live = icount > 0
    assert (icount <= item_rows).all() and (icount >= 0).all()
    assert (istart[live] % 8 + icount[live] <= window(item_rows)).all(), "inside its window"
    for f, n in zip(first[rows > 0], rows[rows > 0], strict=True):  # the fewest items
        least = -(-n // item_rows) if item_rows % 8 else -(-(f % 8 + n) // item_rows)
        assert ((istart >= f) & (istart < f + n) & live).sum() == least
    assert not live[live.sum():].any(), "unused items last"
    np.testing.assert_array_equal(ie[~live], E)
    np.testing.assert_array_equal(istart[~live], rows.sum())
    covered = np.zeros(p, np.int32)
    for e, r0, n in zip(ie[live], istart[live], icount[live], strict=True):
        covered[r0:r0 + n] += 1
        slot = np.flatnonzero((first <= r0) & (r0 < first + rows) & (rows > 0))
        assert len(slot) == 1 and expert[slot[0]] == e, "an item lies inside its slot"
        assert r0 + n <= first[slot[0]] + rows[slot[0]]
    routed = int(rows.sum())
    np.testing.assert_array_equal(covered[:routed], 1, err_msg="routed rows once")
    np.testing.assert_array_equal(covered[routed:], 0)
    assert (np.diff(istart[live]) > 0).all(), "items in sorted-row order"


@pytest.mark.parametrize("block_k", [64, 128, 192, 256, 320])
def test_fp4_activation_order(block_k):
    """A permutation of each K step; thread c of a quad reads K columns [c bk/4, (c+1) bk/4)
    (its bytes of the code row): operand h, column 8j + 2c + q is, of its word h // 2, nibble
    4j + 2q + h % 2 (registers (n0, n2), (n4, n6), (n1, n3), (n5, n7)); each operand's 16
    columns take 4 from each thread's range."""
    order = fp4_operand_order(block_k)
    np.testing.assert_array_equal(np.sort(order), np.arange(block_k))
    quarter = block_k // 4  # operand 0, j = 0, lanes q = 0, 1 of each thread's first word
    lane1, j1, op1 = 2, 4, 1  # the nibble of lane q = 1, of column block j = 1, of operand 1
    np.testing.assert_array_equal(order[:8], np.repeat(np.arange(4) * quarter, 2)
                                  + np.tile([0, lane1], 4))
    np.testing.assert_array_equal(order[8:10], [j1, j1 + lane1])  # column block j = 1
    np.testing.assert_array_equal(order[16:18], [op1, op1 + lane1])  # operand 1
    for h in range(block_k // 16):
        thread = order[16 * h:16 * h + 16] // (block_k // 4)
        np.testing.assert_array_equal(thread, np.tile(np.repeat(np.arange(4), 2), 2))
    tile = SlotTile(block_k=block_k)
    a = jnp.arange(2 * 2 * block_k, dtype=jnp.float32).reshape(2, 2 * block_k)
    permuted = permute_fp4_activations(a, tile)
    np.testing.assert_array_equal(np.asarray(permuted)[0, block_k:],
                                  block_k + order)  # step 2 permuted the same way
    np.testing.assert_array_equal(np.asarray(_natural_order(permuted, tile)), np.asarray(a))


@pytest.mark.parametrize("fmt,most", [("nvfp4", 1170), ("mxfp4", 2340)])
def test_fp4_scale_tables_past_i32_offsets_refused(fmt, most):
    """The FP4 scale loads take i32 byte offsets: a stack of DeepSeek-V3-sized gate_up experts
    ([4096, 7168]) is refused past the last count whose scale table stays below 2^31 bytes
    (``jax.eval_shape``: nothing allocated)."""
    tile = SlotTile(block_k=256)
    kw = dict(global_rows=4096, tile=tile) if fmt == "nvfp4" else dict(tile=tile)
    assert mosaic.unsupported_reason(fmt, jnp.uint8, 4096, 7168, experts=most, **kw) is None
    assert "below 2^31" in mosaic.unsupported_reason(fmt, jnp.uint8, 4096, 7168,
                                                     experts=most + 1, **kw)
    group = 16 if fmt == "nvfp4" else 32
    sd = jax.ShapeDtypeStruct
    args = [sd((3, 8), jnp.int32), sd((window_rows(4), 7168), jnp.float16),
            sd((most + 1, 4096, 3584), jnp.uint8),
            sd((most + 1, 4096, 7168 // group),
               jnp.float8_e4m3fn if fmt == "nvfp4" else jnp.uint8)]
    if fmt == "nvfp4":  # with its global scales
        args.append(sd((most + 1, 1), jnp.float32))

    def f(work, a, w, scale, global_scale=None):
        return slot_matmul(work, a, w, scale, None, global_scale, fmt=fmt, tile=tile)

    with pytest.raises(NotImplementedError, match="below 2"):
        jax.eval_shape(f, *args)


def test_slot_matmul_bad_inputs_raise():
    w = jnp.zeros((2, 128, 128), jnp.float8_e4m3fn)
    s = jnp.ones((2, 2, 1), jnp.float32)
    work = jnp.zeros((3, 2), jnp.int32)
    a = jnp.zeros((window_rows(4), 128), jnp.float16)
    with pytest.raises(ValueError, match="one window"):
        slot_matmul(work, a[:10], w, s, fp8_block=FP8_BLOCK)
    with pytest.raises(ValueError, match=r"8 rows \(one window of tile.rows=1\), got 7"):
        slot_matmul(work, a[:7], w, s, fp8_block=FP8_BLOCK, tile=SlotTile(rows=1))
    with pytest.raises(ValueError, match="k_splits: expected a positive int dividing the 1 K"):
        slot_matmul(work, a, w, s, fp8_block=FP8_BLOCK, k_splits=2)
    with pytest.raises(ValueError, match=r"scale: expected \(2, 2, 1\)"):
        slot_matmul(work, a, w, s[:, :1], fp8_block=FP8_BLOCK)
    with pytest.raises(ValueError, match="a: expected"):
        slot_matmul(work, a.astype(jnp.bfloat16), w, s, fp8_block=FP8_BLOCK)
    with pytest.raises(ValueError, match=r"row_factor: expected \[16\] float32"):
        slot_matmul(work, a, w, s, fp8_block=FP8_BLOCK, row_factor=jnp.ones((23,)))
    with pytest.raises(ValueError, match=r"bias: expected \[2, 128\] bfloat16"):
        slot_matmul(work, a, w, s, fp8_block=FP8_BLOCK, bias=jnp.ones((2, 128), jnp.int32))
    codes = jnp.zeros((2, 128, 64), jnp.uint8)
    with pytest.raises(ValueError, match="fmt: uint8 weights need"):
        slot_matmul(work, a, codes, jnp.zeros((2, 128, 4), jnp.uint8))
    with pytest.raises(ValueError, match="global_scale"):
        slot_matmul(work, a, codes, jnp.zeros((2, 128, 8), jnp.float8_e4m3fn), fmt="nvfp4")
    with pytest.raises(NotImplementedError, match="row segments"):
        slot_matmul(work, a, codes, jnp.zeros((2, 128, 8), jnp.float8_e4m3fn), None,
                    jnp.ones((2, 4)), fmt="nvfp4")
    with pytest.raises(NotImplementedError, match="N=96 must be a multiple of 64"):
        slot_matmul(work, a, w[:, :96], s, fp8_block=FP8_BLOCK)
    with pytest.raises(NotImplementedError, match="FP8 block"):
        slot_matmul(work, a, w, jnp.ones((2, 4, 1)), fp8_block=(32, 128))
    with pytest.raises(ValueError, match="SlotTile.block_k: expected 64, 128, 192, 256 or 320"):
        SlotTile(block_k=32)
    with pytest.raises(NotImplementedError, match="block_k=256 takes NVFP4 or MXFP4 weights"):
        slot_matmul(work, a, w, s, fp8_block=FP8_BLOCK, tile=SlotTile(block_k=256))
    with pytest.raises(NotImplementedError, match="block_k=192 takes NVFP4 or MXFP4 weights"):
        slot_matmul(work, a, w, s, fp8_block=FP8_BLOCK, tile=SlotTile(block_k=192))
    with pytest.raises(NotImplementedError, match=r"K=96 must be a multiple of block_k=128 \(or "
                       r"of 64\)"):
        slot_matmul(work, a[:, :96], w[..., :96], s, fp8_block=FP8_BLOCK)
    with pytest.raises(NotImplementedError, match=r"K=192 must be a multiple of block_k=128 "
                       r"\(or of 64 at block_k=256\)"):
        slot_matmul(work, jnp.zeros((window_rows(4), 192), jnp.float16),
                    jnp.zeros((2, 128, 96), jnp.uint8), jnp.zeros((2, 128, 12), jnp.uint8),
                    fmt="mxfp4", tile=SlotTile(block_k=128))
    with pytest.raises(NotImplementedError, match="K=288 must be a multiple of block_k=256"):
        slot_matmul(work, jnp.zeros((window_rows(4), 512), jnp.float16),  # 288: not of 64
                    jnp.zeros((2, 128, 144), jnp.uint8), jnp.zeros((2, 128, 9), jnp.uint8),
                    fmt="mxfp4", tile=SlotTile(block_k=256))
    with pytest.raises(ValueError, match=r"a: expected \(16, 512\)"):  # FP4 ragged: padded rows
        slot_matmul(work, jnp.zeros((window_rows(4), 320), jnp.float16),
                    jnp.zeros((2, 128, 160), jnp.uint8), jnp.zeros((2, 128, 10), jnp.uint8),
                    fmt="mxfp4", tile=SlotTile(block_k=256))


# ---------------------------------------------------------------------------------------------
# The decode step against the reference.
# ---------------------------------------------------------------------------------------------

CASES = [  # (T, k, format, variant, patterns); k_splits: gate_up's K steps (FP4: three of 64,
    #   given that tile, its own being one step of 192; FP8: 128 and a ragged 64) in as many
    #   programs
    (1, 4, FP8, dict(), ("random",)),
    (1, 4, FP8, dict(k_splits=(2, 1)), ("random",)),
    (3, 3, FP8, dict(activation="silu", limit=0.3, bias=True), ("random", "zero_experts")),
    (8, 2, FP8, dict(activation="gpt_oss", gate_up_layout="interleaved", limit=0.5,
                     bias=True), ("repeated", "dup_in_token")),
    (33, 2, FP8, dict(), ("one_expert", "all_zero")),  # 33 rows on one expert: three items
    (3, 2, BF16, dict(activation="gelu_tanh"), ("random", "last_expert")),
    (33, 2, BF16, dict(activation="gpt_oss", gate_up_layout="interleaved", limit=0.5,
                       bias=True), ("one_expert",)),
    (3, 3, NVFP4, dict(activation="gelu_tanh", bias=True), ("random", "zero_experts")),
    (33, 2, NVFP4, dict(), ("one_expert",)),
    (8, 2, MXFP4, dict(activation="gpt_oss", gate_up_layout="interleaved", limit=0.5,
                       bias=True), ("repeated", "dup_in_token")),
    (1, 4, MXFP4, dict(), ("random",)),
    (2, 4, NVFP4, dict(k_splits=(3, 1), tile=(SlotTile(block_k=64),) * 2), ("random",)),
    (1, 4, MXFP4, dict(k_splits=(3, 1), tile=(SlotTile(block_k=64),) * 2), ("random",)),
    # 9 tokens, 1.5 rows an expert: items of 8 past 8 tokens (SMALL_ITEM_DENSITY), an expert's
    # 9 rows in two of them
    (9, 1, NVFP4, dict(bias=True), ("random", "one_expert")),
]


@pytest.mark.parametrize("t,k,fmt,variant,patterns", CASES,
                         ids=[f"T{c[0]}-k{c[1]}-{c[2].value}-{i}" for i, c in enumerate(CASES)])
def test_pairs_against_reference(t, k, fmt, variant, patterns):
    variant = dict(variant)
    kw = arrays(fmt, bias=variant.pop("bias", False))
    opts = {key: variant.pop(key) for key in ("k_splits", "tile") if key in variant}
    x = x_rows(t)
    for i, pattern in enumerate(patterns):
        ids = routing(pattern, t, k, seed=i)
        out = moe_decode_mosaic_pairs(x, ids, interpret=True, **opts, **kw, **variant)
        ref = moe_decode_pairs_reference(x, ids, h_dtype=jnp.bfloat16, **kw, **variant)
        assert_pairs_close(out, ref, ids, E)


FUSED_CASES = [  # (T, k, format, arrays' keywords, variant, routing pattern)
    (3, 3, FP8, dict(bias=True), dict(activation="silu", limit=0.3), "zero_experts"),
    (8, 2, FP8, dict(bias=True, inter=192), dict(  # down's K ragged: 128 + 64
        activation="gpt_oss", gate_up_layout="interleaved", limit=0.5, k_splits=(2, 2)),
     "dup_in_token"),
    (33, 2, FP8, dict(), dict(), "one_expert"),  # 33 rows on one expert: three items
    (3, 3, NVFP4, dict(bias=True), dict(activation="gelu_tanh", k_splits=(3, 1),
                                        tile=(SlotTile(block_k=64),) * 2), "random"),
    (8, 2, MXFP4, dict(bias=True), dict(activation="gpt_oss", gate_up_layout="interleaved",
                                        limit=0.5), "repeated"),
]


@pytest.mark.parametrize("rows", [4, 16])
def test_fused_launch_h_program_rows(monkeypatch, rows):
    """The interpreter's h programs of 4 and 16 rows (``H_PROGRAM_ROWS``) give the same pairs
    as the three launches."""
    kw = arrays(FP8, bias=True)
    x, ids = x_rows(5), routing("repeated", 5, 4, seed=2)
    with mosaic_constants(monkeypatch, H_PROGRAM_ROWS=rows):
        fused = moe_decode_mosaic_pairs(x, ids, interpret=True, fused=True, **kw)
        three = moe_decode_mosaic_pairs(x, ids, interpret=True, fused=False, **kw)
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(three))


@pytest.mark.parametrize("t,k,fmt,arrays_kw,variant,pattern", FUSED_CASES,
                         ids=[f"T{c[0]}-k{c[1]}-{c[2].value}-{i}"
                              for i, c in enumerate(FUSED_CASES)])
def test_fused_launch_equals_three(t, k, fmt, arrays_kw, variant, pattern):
    """gate_up, h and down in one launch (``slot_mlp``, interpret mode: its programs one after
    another in grid order, the h program's jnp twin) give the three launches' pairs bit for
    bit, and the reference's."""
    kw = arrays(fmt, **arrays_kw)
    x, ids = x_rows(t), routing(pattern, t, k, seed=3)
    fused = moe_decode_mosaic_pairs(x, ids, interpret=True, fused=True, **kw, **variant)
    three = moe_decode_mosaic_pairs(x, ids, interpret=True, fused=False, **kw, **variant)
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(three))
    variant.pop("k_splits", None), variant.pop("tile", None)
    ref = moe_decode_pairs_reference(x, ids, h_dtype=jnp.bfloat16, **kw, **variant)
    assert_pairs_close(fused, ref, ids, kw["gate_up"].shape[0])


@pytest.mark.parametrize("t,k,fmt,arrays_kw,variant,pattern", [
    (1, 4, NVFP4, dict(bias=True), dict(), "random"),
    (2, 3, MXFP4, dict(), dict(activation="gpt_oss", gate_up_layout="interleaved", limit=0.5,
                               k_splits=(3, 2), tile=(SlotTile(block_k=64),) * 2),
     "dup_in_token"),
    (7, 2, FP8, dict(bias=True), dict(activation="silu", limit=0.3), "zero_experts"),
    (8, 2, FP8, dict(bias=True, inter=192), dict(k_splits=(2, 2)), "repeated"),  # ragged K
    (3, 3, NVFP4, dict(), dict(activation="gelu_tanh", k_splits=(3, 1),
                               tile=(SlotTile(block_k=64),) * 2), "one_expert")], ids=str)
def test_down_makes_h(monkeypatch, t, k, fmt, arrays_kw, variant, pattern):
    """``DOWN_MAKES_H_TOKENS`` (three launches): each down program's own h gives the pairs of
    the h launch's rows (within f32 rounding: its h scaled against its K split's max) and the
    reference's; a down K that is not a multiple of its step keeps the h launch (bit for
    bit)."""
    kw = arrays(fmt, **arrays_kw)
    x, ids = x_rows(t), routing(pattern, t, k, seed=5)
    with mosaic_constants(monkeypatch, DOWN_MAKES_H_TOKENS=0):
        three = moe_decode_mosaic_pairs(x, ids, interpret=True, fused=False, **kw, **variant)
    calls = []
    real_h_rows = mosaic.h_rows
    monkeypatch.setattr(mosaic, "h_rows", lambda *a, **k: calls.append(1) or real_h_rows(*a, **k))
    with mosaic_constants(monkeypatch, DOWN_MAKES_H_TOKENS=64):
        own = moe_decode_mosaic_pairs(x, ids, interpret=True, fused=False, **kw, **variant)
    ragged = arrays_kw.get("inter", 128) % 128 != 0
    assert bool(calls) == ragged, "the h launch runs only where down's K is ragged"
    if ragged:
        np.testing.assert_array_equal(np.asarray(own), np.asarray(three))
    np.testing.assert_allclose(np.asarray(own), np.asarray(three), rtol=1e-5,
                               atol=1e-5 * np.abs(np.asarray(three)).max())
    variant.pop("k_splits", None), variant.pop("tile", None)
    ref = moe_decode_pairs_reference(x, ids, h_dtype=jnp.bfloat16, **kw, **variant)
    assert_pairs_close(own, ref, ids, kw["gate_up"].shape[0])


def test_down_makes_h_up_to_its_tokens(monkeypatch):
    """By default the down programs make their own h up to ``DOWN_MAKES_H_TOKENS`` (7) tokens
    and the h launch runs past that (three launches; each down program would remake its
    item's h from more rows)."""
    assert mosaic.DOWN_MAKES_H_TOKENS == 7
    kw = arrays(FP8)
    calls = []
    real_h_rows = mosaic.h_rows
    monkeypatch.setattr(mosaic, "h_rows", lambda *a, **k: calls.append(1) or real_h_rows(*a, **k))
    for t, h_launch in ((7, False), (8, True)):
        calls.clear()
        x, ids = x_rows(t), routing("random", t, 2, seed=t)
        out = moe_decode_mosaic_pairs(x, ids, interpret=True, fused=False, **kw)
        assert bool(calls) == h_launch, t
        ref = moe_decode_pairs_reference(x, ids, h_dtype=jnp.bfloat16, **kw)
        assert_pairs_close(out, ref, ids, E)


@pytest.mark.parametrize("name,fmt,t,h,inter,e,k,takes", [
    ("qwen3", "nvfp4", 3, 2048, 768, 128, 8, True),  # 12 KB
    ("gpt-oss", "mxfp4", 1, 2880, 2880, 32, 4, True),  # K over 3 programs: 15 KB
    ("gpt-oss", "mxfp4", 4, 2880, 2880, 32, 4, False),  # one program over K: 45 KB
    ("deepseek-v3", "fp8", 1, 7168, 2048, 257, 9, False),  # 32 KB
    ("mixtral", "fp8", 3, 4096, 14336, 8, 2, False),  # 224 KB: past the SMEM of a CTA
    ("mixtral", "nvfp4", 7, 4096, 14336, 8, 2, False),
    ("qwen3", "fp8", 8, 2048, 768, 128, 8, False),  # past DOWN_MAKES_H_TOKENS
])
def test_down_makes_h_within_its_tile_bytes(name, fmt, t, h, inter, e, k, takes):
    """The decode step's rule for the down programs' own h at model shapes, with the step's
    own item rows and K splits: only h tiles of at most ``H_TILE_MAX_BYTES`` (Mixtral's would
    not fit a CTA's SMEM)."""
    tile = choose_slot_tile(inter, fmt=fmt, rows=choose_item_rows(t, fmt))
    splits = choose_k_splits(min(e, t * k), h, inter, tile)
    assert mosaic.down_makes_h(t, fmt, inter, tile, splits) is takes


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: compiles Mixtral's decode step")
@pytest.mark.parametrize("fmt,t", [(Format.FP8_BLOCK, 3), (Format.FP8_BLOCK, 7),
                                   (Format.NVFP4, 4)], ids=str)
def test_compiled_mixtral_decode_on_gpu(fmt, t):
    """Mixtral's experts (8 x [28672, 4096] / [4096, 14336], top-2) at 3-7 tokens, the step
    whose down launch asked 248-264 KB of SMEM before ``H_TILE_MAX_BYTES``: ``moe_forward``
    (Mosaic under "auto" on Hopper) compiles and equals the XLA decode path."""
    cfg = aj.MoEConfig(hidden_size=4096, intermediate_size=14336, num_experts=8, top_k=2,
                       expert_format=fmt)
    p = aj.moe.init_params(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(t), (t, 4096), jnp.bfloat16)

    def step(kernels):
        return jax.jit(lambda p, x: aj.moe_forward(p, x, kernels=kernels))(p, x).astype(
            jnp.float32)

    ref = step(aj.KernelConfig(grouped_matmul="xla", moe_path="decode"))
    out = step(aj.KernelConfig(grouped_matmul="pallas", moe_path="decode"))
    assert float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) < 1e-2


def test_down_makes_h_falls_back_past_its_tile_bytes(monkeypatch):
    """An h tile one byte past ``H_TILE_MAX_BYTES`` takes the h launch, one at the bound the
    down programs' own h; both equal the reference."""
    kw = arrays(NVFP4)
    x, ids = x_rows(3), routing("random", 3, 2, seed=2)
    tile = SlotTile(block_k=64, rows=8)
    tile_bytes = I * window(8) * 2  # f16 [window, I]: all of I in one program
    calls = []
    real_h_rows = mosaic.h_rows
    monkeypatch.setattr(mosaic, "h_rows", lambda *a, **k: calls.append(1) or real_h_rows(*a, **k))
    ref = moe_decode_pairs_reference(x, ids, h_dtype=jnp.bfloat16, **kw)
    for limit, h_launch in ((tile_bytes - 1, True), (tile_bytes, False)):
        calls.clear()
        with mosaic_constants(monkeypatch, H_TILE_MAX_BYTES=limit):
            out = moe_decode_mosaic_pairs(x, ids, interpret=True, fused=False, k_splits=(1, 1),
                                          tile=(tile, tile), **kw)
        assert bool(calls) == h_launch, limit
        assert_pairs_close(out, ref, ids, E)


# The blocked plan at every token count, format and density (the default takes it where timed)
EVERY_BLOCKED = dict(BLOCKED_ITEM_TOKENS=(2, 64), BLOCKED_FORMATS=("fp8", "nvfp4", "mxfp4"),
                     BLOCKED_MAX_DENSITY=float("inf"))
BLOCKED_CASES = [  # (T, k, format, routing patterns, fused)
    (33, 2, FP8, ("one_expert", "random"), False),  # 33 rows on one expert: five blocks
    (12, 2, NVFP4, ("repeated", "zero_experts"), True),
    (9, 3, MXFP4, ("random",), None),
    (2, 4, FP8, ("dup_in_token",), None),
]


@pytest.mark.parametrize("t,k,fmt,patterns,fused", BLOCKED_CASES,
                         ids=[f"T{c[0]}-k{c[1]}-{c[2].value}" for c in BLOCKED_CASES])
def test_blocked_items_against_reference(monkeypatch, t, k, fmt, patterns, fused):
    """The blocked plan (``BLOCKED_ITEM_TOKENS``): each expert's rows from a block of 8 of its
    own (``kernel.blocked_plan``), items of 8: the pairs equal the reference's, each item lies
    in one block, and the radix plan program makes the XLA plan's blocks."""
    kw = arrays(fmt, bias=True)
    x = x_rows(t)
    with mosaic_constants(monkeypatch, **EVERY_BLOCKED):
        for i, pattern in enumerate(patterns):
            ids = routing(pattern, t, k, seed=i)
            out = moe_decode_mosaic_pairs(x, ids, interpret=True, fused=fused, **kw)
            ref = moe_decode_pairs_reference(x, ids, h_dtype=jnp.bfloat16, **kw)
            assert_pairs_close(out, ref, ids, E)
            plan = make_plan(ids, E, blocked=True)
            radix = make_plan(ids, E, pallas=True, interpret=True, blocked=True)
            for name in ("work", "token_of_row", "row_of_pair", "routed", "items"):
                np.testing.assert_array_equal(getattr(radix, name), getattr(plan, name), name)
            expert, first, count = np.asarray(plan.items)
            assert (first[count > 0] % 8 == 0).all() and (count <= 8).all()
            assert count.sum() == int(np.asarray(plan.routed).sum())
            rows = np.asarray(plan.row_of_pair)[np.asarray(plan.routed)]
            assert len(set(rows.tolist())) == rows.size  # one row a routed pair
            tok = np.asarray(plan.token_of_row)
            np.testing.assert_array_equal(tok[rows], np.nonzero(np.asarray(plan.routed))[0])
            assert (np.delete(tok, rows) == -1).all()  # padding rows


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda f: f.value)
def test_default_blocked_plan_where_timed(monkeypatch, fmt):
    """With the code's constants, an FP4 step of 20 tokens over experts of ~1 row each (20 x 2
    pairs, 32 experts) takes the blocked plan and equals the reference; FP8 does not take it."""
    calls = []
    make = mosaic.make_plan

    def spy(*args, **kw):
        calls.append(kw.get("blocked", False))
        return make(*args, **kw)

    monkeypatch.setattr(mosaic, "make_plan", spy)
    e, rng = 32, np.random.default_rng(3)
    ids = jnp.asarray(np.stack([rng.permutation(e)[:2] for _ in range(20)]), jnp.int32)
    x = x_rows(20)
    kw = arrays(fmt, e=e, bias=True)
    out = moe_decode_mosaic_pairs(x, ids, interpret=True, **kw)
    assert calls == [True]
    assert_pairs_close(out, moe_decode_pairs_reference(x, ids, h_dtype=jnp.bfloat16, **kw), ids,
                       e)
    calls.clear()
    moe_decode_mosaic_pairs(x, ids, interpret=True, **arrays(FP8, e=e))
    assert calls == []  # FP8's 40 pairs: the plan + x rows launch, not make_plan's blocks


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled Mosaic GPU kernels")
@pytest.mark.parametrize("t", [9, 33])
@pytest.mark.parametrize("fmt", [FP8, NVFP4, MXFP4], ids=lambda f: f.value)
@pytest.mark.parametrize("fused", [False, True], ids=["three_launches", "one_launch"])
def test_compiled_blocked_items_on_gpu(monkeypatch, t, fmt, fused):
    """The blocked plan compiled: the radix plan program's blocks (Triton) equal XLA's, and
    the Mosaic kernels on them equal the reference (padding rows between the blocks)."""
    with mosaic_constants(monkeypatch, **EVERY_BLOCKED):
        rng = np.random.default_rng(t)  # Qwen3's routing: 8 of 128 experts a token
        ids = jnp.asarray(np.stack([rng.permutation(128)[:8] for _ in range(t)]), jnp.int32)
        plan = make_plan(ids, 128, blocked=True)
        radix = jax.jit(lambda i: make_plan(i, 128, pallas=True, blocked=True))(ids)
        for name in ("work", "token_of_row", "row_of_pair", "routed", "items"):
            np.testing.assert_array_equal(getattr(radix, name), getattr(plan, name), name)
        check_compiled(fmt, (1, 1), t, fused, inter=512)


@pytest.mark.parametrize("t,k,e", [(12, 8, 128), (2, 4, 32)])
def test_blocked_radix_plan_lowers_for_h200(t, k, e):
    """The radix plan program with blocks lowers to Triton for the H200 (no GPU: an abstract
    device), at more pairs than 32 and at fewer (the pairwise plan's range: radix too)."""
    from pallas_kernels._device import abstract_gpu

    f = jax.jit(lambda ids: make_plan(ids, e, pallas=True, blocked=True))
    with abstract_gpu():
        lowered = f.trace(jax.ShapeDtypeStruct((t, k), jnp.int32)).lower(
            lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.parametrize("fmt", [FP8, BF16], ids=lambda v: v.value)
@pytest.mark.parametrize("own_h", [True, False], ids=["own_h", "h_launch"])
def test_fused_by_default_at_fuse_mlp_tokens(fmt, own_h, monkeypatch):
    """``fused=None`` takes the one launch for f16 activations from ``FUSE_MLP_TOKENS[0]`` to
    ``[1]`` tokens (the H200's and H100's timings), from one token fewer where the down
    programs would not make their own h (here: an h tile bound of 0 bytes), and the three
    launches elsewhere and for BF16."""
    lo, hi = mosaic.FUSE_MLP_TOKENS
    with mosaic_constants(monkeypatch, H_TILE_MAX_BYTES=mosaic.H_TILE_MAX_BYTES if own_h else 0):
        first = lo if own_h else lo - 1
        kw = arrays(fmt)
        for t in (1, first - 1, first, hi, hi + 1):
            x, ids = x_rows(t), routing("random", t, 2)
            text = str(jax.make_jaxpr(functools.partial(
                moe_decode_mosaic_pairs, interpret=True, **kw))(x, ids))
            assert ("name=slot_mlp" in text) == (fmt is FP8 and first <= t <= hi), t
            assert ("name=slot_matmul" in text) != ("name=slot_mlp" in text), t
            if fmt is FP8 and t == first - 1:  # two launches with own h, else three
                assert ("name=moe_decode_h_rows" in text) != own_h, t


def test_fused_launch_extra_stack_and_bad_inputs():
    """The shared expert folded in as expert E through the one launch; what it cannot run
    raises."""
    kw, _, extra, x, ids = extra_case(FP8, 4)
    fused = moe_decode_mosaic_pairs(x, ids, interpret=True, extra=extra, fused=True, **kw)
    three = moe_decode_mosaic_pairs(x, ids, interpret=True, extra=extra, fused=False, **kw)
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(three))
    with pytest.raises(NotImplementedError, match="fused: one launch takes f16 activations"):
        moe_decode_mosaic_pairs(x, ids[:, :2], interpret=True, fused=True, **arrays(BF16))
    rows = window_rows(8)
    work = jnp.zeros((3, 4), jnp.int32)
    a, factor = jnp.ones((rows, H), jnp.float16), jnp.ones((rows,), jnp.float32)
    args = (kw["gate_up"], kw["down"], kw["gate_up_scale"], kw["down_scale"])
    opts = dict(fp8_block=FP8_BLOCK, interpret=True)
    with pytest.raises(ValueError, match="extra_gate_up, extra_down: both or neither"):
        slot_mlp(work, a, factor, *args, extra_gate_up=(extra.gate_up, extra.gate_up_scale),
                 **opts)
    with pytest.raises(ValueError, match=r"down: expected \[E, 192, 128\]"):
        slot_mlp(work, a, factor, kw["gate_up"], kw["gate_up"], kw["gate_up_scale"],
                 kw["gate_up_scale"], **opts)
    with pytest.raises(ValueError, match=r"a: expected \[R >= 16, 192\] float16"):
        slot_mlp(work, a.astype(jnp.bfloat16), factor, *args, **opts)
    with pytest.raises(ValueError, match=r"a_factor: expected \[16\] float32"):
        slot_mlp(work, a, factor[:8], *args, **opts)
    with pytest.raises(ValueError, match="tiles: expected the same rows in both"):
        slot_mlp(work, a, factor, *args, tiles=(SlotTile(rows=1), SlotTile()), **opts)
    with pytest.raises(ValueError, match="timeline: the compiled kernel's clock"):
        slot_mlp(work, a, factor, *args, timeline=True, **opts)
    with pytest.raises(ValueError, match=r"timeline: stamps come from the one launch"):
        moe_decode_mosaic_pairs(x, ids, interpret=True, extra=extra, fused=False, timeline=True,
                                **kw)
    with pytest.raises(NotImplementedError, match="slot_mlp: f16 activations"):
        bf = arrays(BF16)
        slot_mlp(work, a, factor, bf["gate_up"], bf["down"], interpret=True)


def test_choose_k_splits(monkeypatch):
    """More programs along K only while the (item, 64-row) programs stay near 4 an SM (1.25x
    slack), keeping >= 2 K steps a program and dividing the steps."""
    gate_up, down = choose_slot_tile(2048), choose_slot_tile(768)  # Qwen3-30B-A3B
    assert choose_k_splits(8, 1536, 2048, gate_up) == 2  # 1 token: 192 programs, 16 steps
    assert choose_k_splits(8, 2048, 768, down) == 2  # 256 programs, 6 steps
    assert choose_k_splits(128, 1536, 2048, gate_up) == 1  # 64 tokens: 3072 programs
    assert choose_k_splits(1, 128, 2048, gate_up) == 8  # 2 programs: 8 splits of 2 steps
    assert choose_k_splits(4, 2880, 2880, choose_slot_tile(2880)) == 3  # 45 steps, 180 progs
    ragged = choose_slot_tile(2880, fmt="fp8")  # 23 steps of 128, the last one ragged
    assert ragged.block_k == 128 and ragged.num_stages == mosaic.NUM_STAGES_LONG
    for fmt in ("nvfp4", "mxfp4"):  # FP4: steps of 256 where they divide K
        assert [choose_slot_tile(k, fmt=fmt).block_k for k in (2048, 768)] == [256, 256]
        assert choose_slot_tile(2048, fmt=fmt).num_stages == mosaic.NUM_STAGES_WIDE
        # else 192 (gpt-oss: 15 steps)
        assert [choose_slot_tile(k, fmt=fmt).block_k for k in (2880, 192)] == [192, 192]
        # else FP4_RAGGED_STEP's 256, the last step ragged, where they are fewer than the
        # steps of 128 / 64: Gemma-4's 704 (3, not 11 of 64), Qwen1.5-MoE's 1408 (6, not 11
        # of 128), 640, 320; a single step of 128 / 64 stays
        ragged_256 = choose_slot_tile(704, fmt=fmt)
        assert ragged_256.block_k == 256 and ragged_256.num_stages == mosaic.NUM_STAGES_WIDE
        assert [choose_slot_tile(k, fmt=fmt).block_k for k in (1408, 640, 320, 128, 64)] == [
            256, 256, 256, 128, 64]
    assert choose_slot_tile(704, fmt="fp8").block_k == 128  # FP8: 128, the last ragged
    monkeypatch.setattr(mosaic, "FP4_RAGGED_STEP", None)  # off: 128 / 64
    assert [choose_slot_tile(k, fmt="nvfp4").block_k for k in (704, 1408, 640, 320, 2880)] == [
        64, 128, 128, 64, 192]
    # FP4_STEPS in their order: 320 before 192 takes gpt-oss's 2880 in 9 steps
    monkeypatch.setattr(mosaic, "FP4_STEPS", (256, 320, 192))
    assert [choose_slot_tile(k, fmt="mxfp4").block_k for k in (2880, 2048, 576)] == [
        320, 256, 192]
    assert choose_slot_tile(2048, fmt="fp8").block_k == 128
    # 4 stages from 20 K steps of 128 (gpt-oss's 23), 3 below (Qwen3's gate_up 16, down 6)
    assert [choose_slot_tile(k, fmt="fp8").num_stages for k in (2560, 2432, 2048, 768)] == [
        4, 3, 3, 3]
    assert choose_k_splits(4, 2880, 2880, ragged) == 1  # 23 steps: no divisor


@pytest.mark.parametrize("fmt", [Format.NVFP4, Format.MXFP4], ids=lambda f: f.value)
def test_ragged_fp4_model_shapes_take_mosaic(fmt):
    """The layers whose K takes the ragged FP4 steps by default (Gemma-4's down K of 704,
    Qwen1.5-MoE's 1408) pass the Mosaic decode kernels' checks, so "auto" keeps them there
    (two experts of each shape)."""
    from atlas_jax.ops.moe_decode import mosaic_unsupported_reason

    for h, inter in ((2816, 704), (2048, 1408)):
        params = make("qwen3", fmt, jnp.bfloat16, hidden_size=h, intermediate_size=inter,
                      num_experts=2)
        assert choose_slot_tile(inter, fmt=format_name(fmt.value, jnp.uint8)).block_k == 256
        x = jnp.ones((1, h), jnp.bfloat16)
        assert mosaic_unsupported_reason(x, params.gate_up, params.down) is None


def extra_case(fmt, t: int):
    """(main stack's keywords, the extra stack's, ``ExtraExperts``, x [t, H], ids [t, 3]): two
    routed slots and the shared expert (id E) in the third."""
    kw = arrays(fmt)
    extra_kw = arrays(fmt, e=1, seed=5)
    extra = ExtraExperts(**{name: v for name, v in extra_kw.items()
                            if name not in ("fmt", "block_size")})
    ids = jnp.concatenate([routing("random", t, 2), jnp.full((t, 1), E, jnp.int32)], axis=1)
    return kw, extra_kw, extra, x_rows(t), ids


@pytest.mark.parametrize("fmt", [FP8, BF16, NVFP4, MXFP4], ids=lambda v: v.value)
def test_extra_stack(fmt):
    """A shared expert folded in as expert id E (every token), and routed pairs beside it
    (MXFP4: the extra stack's own scales' row tops)."""
    kw, extra_kw, extra, x, ids = extra_case(fmt, 5)
    t = 5
    out = moe_decode_mosaic_pairs(x, ids, interpret=True, extra=extra, **kw)
    ref = moe_decode_pairs_reference(x, ids[:, :2], h_dtype=jnp.bfloat16, **kw)
    ref_shared = moe_decode_pairs_reference(x, jnp.zeros((t, 1), jnp.int32),
                                            h_dtype=jnp.bfloat16, **extra_kw)
    assert_pairs_close(out[:, :2], ref, ids[:, :2], E)
    assert_pairs_close(out[:, 2:], ref_shared, jnp.zeros((t, 1), jnp.int32), 1)
    with pytest.raises(ValueError, match="biases"):
        moe_decode_mosaic_pairs(x, ids, interpret=True, extra=extra,
                                **arrays(fmt, bias=True))


def test_pairs_bad_inputs_raise():
    kw = arrays(FP8)
    ids = routing("random", 2, 2)
    with pytest.raises(NotImplementedError, match="bf16"):
        moe_decode_mosaic_pairs(x_rows(2).astype(jnp.float32), ids, interpret=True, **kw)
    with pytest.raises(ValueError, match="down: expected shape"):
        moe_decode_mosaic_pairs(x_rows(2), ids, interpret=True,
                                **dict(kw, down=kw["down"][:, :64]))
    with pytest.raises(ValueError, match="tile: expected the same rows in both"):
        moe_decode_mosaic_pairs(x_rows(2), ids, interpret=True, **kw,
                                tile=(SlotTile(rows=2), SlotTile(rows=4)))


# ---------------------------------------------------------------------------------------------
# moe_forward through KernelConfig.decode_kernel.
# ---------------------------------------------------------------------------------------------

MOSAIC = aj.KernelConfig(grouped_matmul="pallas", moe_path="decode", decode_kernel="mosaic")
TRITON = aj.KernelConfig(grouped_matmul="pallas", moe_path="decode", decode_kernel="triton")
XLA = aj.KernelConfig(grouped_matmul="xla", moe_path="decode")
_make = jax.jit(make, static_argnames=("name", "fmt", "dtype", "shared_expert_format",
                                       "hidden_size", "intermediate_size",
                                       "shared_intermediate_size", "gate_up_act_quant",
                                       "down_act_quant"))
LAYER = dict(hidden_size=128, intermediate_size=64)


@pytest.mark.parametrize("name,fmt,tokens", [
    ("qwen3", Format.FP8_BLOCK, 3),
    ("gpt_oss", Format.FP8_BLOCK, 5),  # interleaved, biases, clamped activation
    ("deepseek_v3", Format.FP8_BLOCK, 4),  # the shared expert folds into the launches
    ("longcat", Format.BF16, 6),  # zero experts
    ("qwen3", Format.NVFP4, 3),
    ("deepseek_v3", Format.NVFP4, 4),  # a folded NVFP4 shared expert: its own global scales
    ("gpt_oss", Format.MXFP4, 5),
])
def test_moe_forward_mosaic_equals_triton_and_xla(name, fmt, tokens):
    shared = dict(shared_intermediate_size=64) if name == "deepseek_v3" else {}
    p = _make(name=name, fmt=fmt, dtype=jnp.bfloat16, **LAYER, **shared)
    x = jax.random.normal(jax.random.key(1), (tokens, 128), jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(aj.moe_forward, static_argnames="kernels")
    y = f(p, x, kernels=MOSAIC)
    chex.assert_type(y, jnp.bfloat16)
    chex.assert_tree_all_finite(y)
    assert rel_err(y, f(p, x, kernels=TRITON)) < 1e-2
    assert rel_err(y, f(p, x, kernels=XLA)) < 1e-2


def test_decode_kernel_choice_and_errors(monkeypatch):
    """"auto" takes Mosaic GPU on sm_90 for FP8 W8A16, NVFP4 and MXFP4 at any token count;
    "mosaic" raises naming the reason for what it cannot run."""
    from pallas_kernels import grouped_matmul as gm

    fp8 = _make(name="qwen3", fmt=Format.FP8_BLOCK, dtype=jnp.bfloat16, **LAYER)
    bf16 = _make(name="qwen3", fmt=Format.BF16, dtype=jnp.bfloat16, **LAYER)
    x = jnp.zeros((2, 128), jnp.bfloat16)
    none = dict(gate_up_act_quant=ActQuant.NONE, down_act_quant=ActQuant.NONE)
    auto = aj.KernelConfig()

    def use(params, kernels, cc=(9, 0), tokens=2):
        monkeypatch.setattr(ops_decode, "interpret_mode", lambda: False)
        monkeypatch.setattr(gm, "device_compute_capability", lambda: cc)
        xt = jnp.zeros((tokens, 128), jnp.bfloat16)
        return ops_decode._use_mosaic(xt, params.gate_up, params.down, kernels, none)

    assert use(fp8, auto)
    assert not use(bf16, auto)  # BF16: the Triton kernels measured as fast or faster
    assert not use(fp8, auto, cc=(10, 0))
    assert not use(fp8, TRITON)
    assert use(bf16, MOSAIC)
    for fmt in (Format.NVFP4, Format.MXFP4):
        fp4 = _make(name="gpt_oss" if fmt is Format.MXFP4 else "qwen3", fmt=fmt,
                    dtype=jnp.bfloat16, **LAYER)
        assert use(fp4, auto, tokens=1) and use(fp4, auto, tokens=64)
        assert not use(fp4, auto, tokens=8, cc=(12, 0))
        assert use(fp4, MOSAIC)
    monkeypatch.undo()

    w8a8 = _make(name="qwen3", fmt=Format.FP8_BLOCK, dtype=jnp.bfloat16, **LAYER,
                 gate_up_act_quant="fp8")
    with pytest.raises(NotImplementedError, match="W8A8"):
        aj.moe_forward(w8a8, x, kernels=MOSAIC)
    odd = _make(name="qwen3", fmt=Format.FP8_BLOCK, dtype=jnp.bfloat16, hidden_size=96,
                intermediate_size=64)
    with pytest.raises(NotImplementedError, match="K=96"):
        aj.moe_forward(odd, jnp.zeros((2, 96), jnp.bfloat16), kernels=MOSAIC)
    with pytest.raises(NotImplementedError, match="bf16 activations"):
        aj.moe_forward(fp8, x.astype(jnp.float32), kernels=MOSAIC)


# ---------------------------------------------------------------------------------------------
# The compiled build: lowered for sm_90 on any machine, run on a GPU.
# ---------------------------------------------------------------------------------------------


class TestLowersForHopper:
    """The Mosaic GPU lowering (layout inference included) of the register-operand build, for
    the model shapes it serves, without a GPU (``jax.export`` for the CUDA platform)."""

    @pytest.mark.parametrize("fmt,n,k,k_splits", [
        (FP8, 1536, 2048, 1),  # Qwen3-30B-A3B gate_up
        (FP8, 2880, 2880, 1),  # gpt-oss-120b down: 23 K steps of 128, the last ragged
        (FP8, 1536, 2048, 2),  # K over two programs
        (BF16, 2048, 768, 1),  # Qwen3-30B-A3B down
        (BF16, 2880, 2880, 1),  # 23 K steps of 128, the last ragged
        (NVFP4, 1536, 2048, 1),
        (NVFP4, 1536, 2048, 2),
        (NVFP4, 2048, 768, 3),  # 3 K steps of 256, one a program
        (MXFP4, 1536, 2048, 1),  # 8 K steps of 256
        (MXFP4, 5760, 2880, 1),  # gpt-oss-120b gate_up
        (MXFP4, 2880, 2880, 3),
    ], ids=lambda v: getattr(v, "value", v))
    def test_lowers(self, fmt, n, k, k_splits):
        """Main stack and a folded one-expert extra stack, as the decode step launches them,
        with the epilogue's row factors (f16 activations) and a bf16 bias."""
        self.lower_slot_matmul(fmt, n, k, k_splits)

    @staticmethod
    def lower_slot_matmul(fmt, n, k, k_splits) -> str:
        """``test_lowers``' case lowered: the module's text."""
        p, e = 64, 8
        name = format_name(fmt, None)
        w_dtype = {FP8: jnp.float8_e4m3fn, BF16: jnp.bfloat16}.get(fmt, jnp.uint8)
        kw_ = k // 2 if fmt in FP4 else k

        def stack(g):  # (w, scale, global_scale) shapes of a stack of g experts
            match fmt:
                case WeightFormat.FP8_BLOCK:
                    scale = ((g, -(-n // 128), -(-k // 128)), jnp.float32)
                case WeightFormat.NVFP4:
                    scale = ((g, n, k // 16), jnp.float8_e4m3fn)
                case WeightFormat.MXFP4:
                    scale = ((g, n, k // 32), jnp.uint8)
                case _:
                    scale = None
            glob = ((g, 2), jnp.float32) if fmt is NVFP4 else None
            return [jax.ShapeDtypeStruct((g, n, kw_), w_dtype)] + [
                jax.ShapeDtypeStruct(*v) for v in (scale, glob) if v is not None]

        main, extra = stack(e), stack(1)
        tile = choose_slot_tile(k, fmt=name)
        width = num_k_steps(k, tile) * tile.block_k if fmt in FP4 else k  # a ragged K padded
        args = [jax.ShapeDtypeStruct((3, e + p // ROWS), jnp.int32),
                jax.ShapeDtypeStruct((window_rows(p), width),
                                     jnp.bfloat16 if fmt is BF16 else jnp.float16),
                jax.ShapeDtypeStruct((window_rows(p),), jnp.float32),
                jax.ShapeDtypeStruct((e, n), jnp.bfloat16), *main, *extra]

        def f(work, a, factor, bias, *arrays):
            main_, extra_ = arrays[:len(main)], arrays[len(main):]
            pad = (None,) * (3 - len(main))
            w, scale, glob = (*main_, *pad)
            return slot_matmul(work, a, w, scale, (*extra_, *pad), glob, fmt=name,
                               row_factor=None if fmt is BF16 else factor, bias=bias,
                               fp8_block=(128, 128) if fmt is FP8 else None,
                               tile=choose_slot_tile(k, fmt=name), k_splits=k_splits)

        text = export.export(jax.jit(f), platforms=["cuda"])(*args).mlir_module()
        assert "mosaic_gpu" in text
        return text

    @pytest.mark.parametrize("fmt", [FP8, MXFP4], ids=lambda v: v.value)
    def test_epilogue_loads_after_steps_lower(self, monkeypatch, fmt):
        """The one launch with the epilogue's loads after the K steps."""
        with mosaic_constants(monkeypatch, EPILOGUE_LOADS_AHEAD=False):
            self.lower_one_launch(fmt, 2048, 768, (1, 1), dict(rows=8))

    @pytest.mark.parametrize("parts", [1, 4])
    @pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda v: v.value)
    def test_fp4_parts_lower(self, monkeypatch, fmt, parts):
        """FP4 K steps of 256 dotted as one wgmma or four (8-byte code loads a part); an
        unsupported count is refused."""
        with mosaic_constants(monkeypatch, FP4_PARTS=parts):
            self.test_lowers(fmt, 1536, 2048, 1)
        with mosaic_constants(monkeypatch, FP4_PARTS=3), pytest.raises(
                ValueError, match="3 parts of a K step of 256"):
            self.test_lowers(fmt, 1536, 2048, 1)

    @pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda v: v.value)
    def test_fp4_parts_192_lower(self, monkeypatch, fmt):
        """gpt-oss's K steps of 192 dotted as three wgmmas (``FP4_PARTS_192``), in its three
        launches and its one launch; two parts (12 bytes of a thread's row) are refused."""
        with mosaic_constants(monkeypatch, FP4_PARTS_192=3, H_KEEP_CHUNKS=8):
            self.lower_slot_matmul(fmt, 5760, 2880, 3)
            self.lower_one_launch(fmt, 2880, 2880, (1, 1), dict(
                activation="gpt_oss", layout="interleaved", limit=7.0, rows=8))
        with mosaic_constants(monkeypatch, FP4_PARTS_192=2), pytest.raises(
                ValueError, match="2 parts of a K step of 192"):
            self.test_lowers(fmt, 5760, 2880, 1)

    @pytest.mark.parametrize("fmt,n,k,k_splits,gu_splits,rows,gpt_oss", [
        (FP8, 2048, 768, 1, 2, 8, False), (NVFP4, 2048, 768, 3, 2, 8, False),
        (MXFP4, 2048, 768, 1, 1, 1, False), (MXFP4, 2880, 2880, 3, 3, 8, True),
        (NVFP4, 2880, 2880, 5, 1, 16, True)], ids=str)
    def test_h_source_lowers(self, fmt, n, k, k_splits, gu_splits, rows, gpt_oss):
        """The own-h down launch (the programs' h tile in SMEM, the pipeline on the
        weights alone) for Qwen3's and gpt-oss's down shapes, with the extra stack."""
        p, e = 64, 8
        name = format_name(fmt, None)
        w_dtype = jnp.float8_e4m3fn if fmt is FP8 else jnp.uint8
        kw_ = k // 2 if fmt in FP4 else k
        scale = {FP8: ((e, -(-n // 128), -(-k // 128)), jnp.float32),
                 NVFP4: ((e, n, k // 16), jnp.float8_e4m3fn),
                 MXFP4: ((e, n, k // 32), jnp.uint8)}[fmt]
        arrays = [jax.ShapeDtypeStruct((e, n, kw_), w_dtype), jax.ShapeDtypeStruct(*scale)]
        if fmt is NVFP4:
            arrays.append(jax.ShapeDtypeStruct((e, 1), jnp.float32))
        r = window_rows(p, rows)
        args = [jax.ShapeDtypeStruct((3, e + p), jnp.int32),
                jax.ShapeDtypeStruct((gu_splits * r, 2 * k), jnp.float32), *arrays]
        act, layout = ((Activation.GPT_OSS, GateUpLayout.INTERLEAVED) if gpt_oss
                       else (Activation.SILU, GateUpLayout.CONCATENATED))
        source = HSource(gu_splits, act, layout, 7.0 if gpt_oss else None,
                         mosaic.GPT_OSS_ALPHA)

        def f(work, gu, w, scale, glob=None):
            return slot_matmul(work, gu, w, scale, None, glob, fmt=name, h_source=source,
                               fp8_block=(128, 128) if fmt is FP8 else None,
                               tile=choose_slot_tile(k, fmt=name, rows=rows),
                               k_splits=k_splits)

        text = export.export(jax.jit(f), platforms=["cuda"])(*args).mlir_module()
        assert "mosaic_gpu" in text

    @pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda v: v.value)
    def test_fp4_steps_320_lower(self, monkeypatch, fmt):
        """gpt-oss's K in 9 steps of 320 (``FP4_STEPS``, five parts of 64), its three launches'
        gate_up and its one launch."""
        with mosaic_constants(monkeypatch, FP4_STEPS=(256, 320, 192), H_KEEP_CHUNKS=8):
            self.lower_slot_matmul(fmt, 5760, 2880, 3)
            self.lower_one_launch(fmt, 2880, 2880, (1, 1), dict(
                activation="gpt_oss", layout="interleaved", limit=7.0, rows=8))

    @pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda v: v.value)
    def test_fp4_ragged_step_lowers(self, monkeypatch, fmt):
        """``FP4_RAGGED_STEP`` (``FP4_STEPS`` 256 only): gpt-oss's gate_up (K of 2880) in 12
        steps of 256, the last ragged (32-byte code swizzle, clamped scale loads), alone and K
        split in three; its one launch (the h program's rows padded, zeros past I); its own-h
        down launch (the last split's h tile zero past I)."""
        with mosaic_constants(monkeypatch, FP4_STEPS=(256,), FP4_RAGGED_STEP=256):
            assert choose_slot_tile(2880, fmt=format_name(fmt, None)).block_k == 256
            self.lower_slot_matmul(fmt, 5760, 2880, 3)
            self.lower_slot_matmul(fmt, 5760, 2880, 1)
            self.lower_one_launch(fmt, 2880, 2880, (1, 3), dict(
                activation="gpt_oss", layout="interleaved", limit=7.0, rows=8))
            self.test_h_source_lowers(fmt, 2880, 2880, 3, 3, 8, True)

    @pytest.mark.parametrize("n,k,k_splits", [(1536, 2048, 1), (5760, 2880, 1),
                                              (2880, 2880, 3), (2048, 768, 3)])
    def test_mx_row_max_lowers(self, n, k, k_splits):
        """MXFP4 (the row-max pre-pass, own scale bytes, one accumulator) for Qwen3's and
        gpt-oss's shapes, and gpt-oss's one launch."""
        self.test_lowers(MXFP4, n, k, k_splits)
        if k == 2880 and k_splits == 1:
            self.lower_one_launch(MXFP4, 2880, 2880, (1, 1), dict(
                activation="gpt_oss", layout="interleaved", limit=7.0, rows=8))

    @pytest.mark.parametrize("fmt,h,inter,k_splits,variant", [
        (FP8, 2048, 768, (1, 1), dict()),  # Qwen3-30B-A3B
        (FP8, 2048, 768, (2, 2), dict(activation="silu", limit=7.0)),
        (FP8, 2880, 2880, (1, 1), dict(activation="gpt_oss", layout="interleaved", limit=7.0)),
        (NVFP4, 2048, 768, (2, 1), dict(activation="gelu_tanh")),  # h in the operand order
        (MXFP4, 2880, 2880, (1, 1), dict(activation="gpt_oss", layout="interleaved",
                                         limit=7.0)),
        (MXFP4, 2880, 2880, (1, 5), dict(activation="gpt_oss", layout="interleaved", limit=7.0,
                                         rows=1, timeline=True)),  # 1 token, clock stamps
        (FP8, 2048, 768, (1, 1), dict(rows=8, timeline=True)),
    ], ids=lambda v: getattr(v, "value", v))
    def test_one_launch_lowers(self, fmt, h, inter, k_splits, variant):
        self.lower_one_launch(fmt, h, inter, k_splits, variant)

    @pytest.mark.parametrize("rows,chunk,keep,roll", [(4, 4, 8, 1), (2, 4, 0, 1), (16, 2, 8, 1),
                                                     (4, 4, 0, 1), (1, 2, 8, 6), (1, 2, 0, 5)])
    @pytest.mark.parametrize("fmt", [FP8, MXFP4], ids=lambda v: v.value)
    def test_h_program_variants_lower(self, monkeypatch, fmt, rows, chunk, keep, roll):
        """The h program's variants (rows a program: a row over several warps takes an SMEM
        step; 8- or 16-byte chunks; values kept or recomputed in rolled loops) for Qwen3's and
        gpt-oss's rows."""
        with mosaic_constants(monkeypatch, H_PROGRAM_ROWS=rows, H_CHUNK=chunk,
                              H_KEEP_CHUNKS=keep, H_ROLL=roll):
            if fmt is FP8:
                self.lower_one_launch(FP8, 2048, 768, (1, 1), {})
            else:
                self.lower_one_launch(MXFP4, 2880, 2880, (1, 1), dict(
                    activation="gpt_oss", layout="interleaved", limit=7.0))

    @staticmethod
    def lower_one_launch(fmt, h, inter, k_splits, variant):
        """``slot_mlp`` (gate_up, the h programs with their semaphores, down) for the model
        shapes, with biases."""
        p, e = 64, 8
        name = format_name(fmt, None)
        variant = dict(variant)
        item_rows = variant.pop("rows", ROWS)
        if "activation" in variant:
            variant["activation"] = Activation(variant["activation"])
        if "layout" in variant:
            variant["layout"] = GateUpLayout(variant["layout"])
        kw = arrays(fmt, e=e, h=h, inter=inter, bias=True, fp8_block=(128, 128))
        names = [n for n in ("gate_up", "down", "gate_up_scale", "down_scale",
                             "gate_up_global_scale", "down_global_scale", "gate_up_bias",
                             "down_bias") if n in kw]
        specs = [jax.ShapeDtypeStruct(kw[n].shape, kw[n].dtype) for n in names]
        rows = window_rows(p, item_rows)
        tiles = (choose_slot_tile(h, fmt=name, rows=item_rows),
                 choose_slot_tile(inter, fmt=name, rows=item_rows))

        def f(work, a, factor, *arrays_):
            return slot_mlp(work, a, factor, **dict(zip(names, arrays_, strict=True)), fmt=name,
                            fp8_block=(128, 128) if fmt is FP8 else None, tiles=tiles,
                            k_splits=k_splits, **variant)

        width = row_width(h, tiles[0].block_k if fmt in FP4 else None)  # a ragged K padded
        args = [jax.ShapeDtypeStruct((3, e + p // ROWS), jnp.int32),
                jax.ShapeDtypeStruct((rows, width), jnp.float16),
                jax.ShapeDtypeStruct((rows,), jnp.float32), *specs]
        text = export.export(jax.jit(f), platforms=["cuda"])(*args).mlir_module()
        assert "mosaic_gpu" in text
        return text


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled Mosaic GPU kernels")
@pytest.mark.parametrize("t", [1, 9, 33])  # 4, 36 and 132 pairs: the plan and x rows in one
#   launch (pairwise plan; radix plan), then in two; windows of 8, 16 and 24 rows
@pytest.mark.parametrize("fmt,k_splits", [
    (FP8, (1, 1)), (BF16, (1, 1)), (NVFP4, (1, 1)), (MXFP4, (1, 1)), (FP8, (2, 2)),
    (NVFP4, (4, 2)), (MXFP4, (2, 1))], ids=str)
@pytest.mark.parametrize("fused", [False, True], ids=["three_launches", "one_launch"])
def test_compiled_on_gpu_against_reference(fmt, k_splits, t, fused):
    """The compiled kernels (weights in registers) against the reference, rows 1e-3 .. 1e3,
    gpt-oss's interleaved, clamped activation with biases, a zero expert, 128 x 128 blocks;
    K split over programs; gate_up, h and down in three launches or one (``slot_mlp``: its
    semaphores and compiled h program)."""
    if fused and fmt is BF16:
        pytest.skip("one launch: f16 activations only")
    check_compiled(fmt, k_splits, t, fused, inter=512)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled Mosaic GPU kernels")
@pytest.mark.parametrize("t", [1, 9])
def test_compiled_one_launch_timeline_on_gpu(t):
    """The one launch's clock stamps: the same pairs as without them; every program's start <=
    its wait's end <= its end (ns, 32-bit differences, under 0.1 s), on an SM of the device;
    the programs that wait (h, down) end their waits after the first program started; phases
    in grid order (gate_up, h, down), items 0.. within each."""
    e, h, k = 16, 1024, 4
    rng = np.random.default_rng(t)
    kw = arrays(FP8, e=e, h=h, inter=512, bias=True, seed=1, fp8_block=(128, 128))
    ids = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(t)]), jnp.int32)
    x = jnp.asarray(rng.standard_normal((t, h)).astype(ml_dtypes.bfloat16))
    plain = moe_decode_mosaic_pairs(x, ids, **kw, fused=True)
    pairs, stamps = moe_decode_mosaic_pairs(x, ids, **kw, fused=True, timeline=True)
    np.testing.assert_array_equal(np.asarray(pairs), np.asarray(plain))
    stamps = np.asarray(stamps).astype(np.int64)
    start, waited, end, sm, phase, item = stamps.T
    wrap = 1 << 32
    assert ((waited - start) % wrap < 10**8).all() and ((end - waited) % wrap < 10**8).all()
    assert ((sm >= 0) & (sm < jax.devices()[0].core_count)).all()
    first = start[0] + ((start - start[0] + wrap // 2) % wrap - wrap // 2).min()  # any SM's
    assert ((waited - first) % wrap < 10**8).all()
    assert stamps.shape[1] == len(mosaic.TIMELINE_COLUMNS)
    assert (np.diff(phase) >= 0).all() and phase[0] == 0 and phase[-1] == 2
    for p in range(3):
        assert (np.diff(item[phase == p]) >= 0).all() and item[phase == p][0] == 0


def check_compiled(fmt, k_splits, t: int, fused: bool, *, inter: int, h: int = 1024,
                   variant=(("activation", "gpt_oss"), ("gate_up_layout", "interleaved"))):
    e, k = 16, 4
    rng = np.random.default_rng(t)
    kw = arrays(fmt, e=e, h=h, inter=inter, bias=True, seed=1, fp8_block=(128, 128))
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)])
    ids[0, -1] = e  # a zero expert
    ids = jnp.asarray(ids, jnp.int32)
    x = rng.standard_normal((t, h)) * np.logspace(-3, 3, t)[:, None]
    x = jnp.asarray(x.astype(ml_dtypes.bfloat16))
    variant = dict(variant)
    out = moe_decode_mosaic_pairs(x, ids, **kw, **variant, k_splits=k_splits, fused=fused)
    ref = moe_decode_pairs_reference(x, ids, h_dtype=jnp.bfloat16, **kw, **variant)
    assert_pairs_close(out, ref, ids, e, tol=5e-3)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled Mosaic GPU kernels")
@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda f: f.value)
@pytest.mark.parametrize("t,fused", [(1, False), (3, False), (12, False), (12, True),
                                     (33, False)])
def test_compiled_fp4_ragged_step_on_gpu(monkeypatch, fmt, t, fused):
    """``FP4_RAGGED_STEP`` compiled end to end (``FP4_STEPS`` 256 only): H = 960 and I = 320 in
    steps of 256 (the last of each ragged), x's and h's rows padded, three launches and the one
    launch's h program."""
    with mosaic_constants(monkeypatch, FP4_STEPS=(256,), FP4_RAGGED_STEP=256):
        check_compiled(fmt, (1, 1), t, fused, inter=320, h=960)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: runs the compiled Mosaic GPU kernels")
@pytest.mark.parametrize("rows,chunk,keep,roll", [(1, 4, 16, 1), (2, 2, 0, 1), (4, 4, 8, 1),
                                                 (16, 2, 16, 1), (1, 2, 0, 3), (2, 4, 0, 2)])
@pytest.mark.parametrize("fmt,inter,variant", [
    (FP8, 448, ()),  # SiLU, concatenated; rows of 448: chunks past the row's end
    (MXFP4, 512, (("activation", "gpt_oss"), ("gate_up_layout", "interleaved")))],
    ids=["fp8", "mxfp4"])
def test_compiled_h_program_variants_on_gpu(monkeypatch, rows, chunk, keep, roll, fmt, inter,
                                            variant):
    """The one launch's compiled h program in its shapes (rows a program: a row over several
    warps takes an SMEM step; 8- or 16-byte chunks; values kept, or recomputed in rolled loops
    of ``roll`` chunks an iteration, the last iteration's chunks past a thread's)."""
    with mosaic_constants(monkeypatch, H_PROGRAM_ROWS=rows, H_CHUNK=chunk, H_KEEP_CHUNKS=keep,
                          H_ROLL=roll):
        check_compiled(fmt, (1, 1), 12, True, inter=inter, variant=variant)


def test_pairs_k_splits_auto_and_bad_values():
    """k_splits="auto" resolves per launch (choose_k_splits; here 1: three K steps) and runs;
    anything but a (gate_up, down) pair or "auto" raises."""
    kw = arrays(FP8)
    x, ids = x_rows(1), routing("random", 1, 2)
    out = moe_decode_mosaic_pairs(x, ids, interpret=True, k_splits="auto", **kw)
    ref = moe_decode_pairs_reference(x, ids, h_dtype=jnp.bfloat16, **kw)
    assert_pairs_close(out, ref, ids, E)
    for bad in (3, (2,), "fast"):
        with pytest.raises(ValueError, match="k_splits: expected"):
            moe_decode_mosaic_pairs(x, ids, interpret=True, k_splits=bad, **kw)
