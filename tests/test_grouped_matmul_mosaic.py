"""Tests of the Mosaic GPU BF16 grouped matmul (pallas_kernels/grouped_matmul/mosaic.py).

The kernel runs under Mosaic GPU's interpreter on CPU (``plgpu.InterpretGPUParams``: warpgroups,
TMA copies with zero fill and store clipping, barriers and SMEM are simulated). The interpreter
fills uninitialized memory, the kernel's output included, with NaN, so "every element finite"
doubles as "every element written" (the poison check); padding rows past ``sum(group_sizes)``
must come out as exact zeros. Shapes are small (each kernel call takes seconds) and cut the
tiles everywhere: ragged and empty groups, M not a multiple of block_m (and M < block_m), the
last column tile shifted left (N not a multiple of block_n), a partial last K step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul.mosaic import (
    MosaicTileConfig,
    choose_mosaic_tile_config,
    grouped_matmul_mosaic,
)
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference

# block_m 64 (work-list tiles of 56 rows), two consumer warpgroups of 64 columns, K steps of 32
# (K = 96 is not a multiple of 64); two CTAs share the work list.
TILE = MosaicTileConfig(block_m=64, block_n=128, block_k=32, num_stages=2, epilogue_n=64,
                        grid_sms=2)
K = 96


def _data(seed: int, m: int, n: int, g: int):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, K), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (g, n, K), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
    return x, w


def _check(out, ref, group_sizes, atol):
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all(), "unwritten (NaN-poisoned) output elements"
    total = int(np.sum(np.asarray(group_sizes)))
    np.testing.assert_array_equal(out[total:], 0.0)  # padding rows
    np.testing.assert_allclose(out[:total], np.asarray(ref)[:total], atol=atol, rtol=2e-2)


def test_plain_ragged_empty_groups_bf16_out():
    # Segments: [0,40) | empty | [40,117) = a full and a 21-row tile | [117,137) | padding
    # [137,150); N = 136 = one tile + a tile shifted left by 120 columns.
    m, n = 150, 136
    group_sizes = jnp.array([40, 0, 77, 20], jnp.int32)
    x, w = _data(0, m, n, 4)
    out = grouped_matmul_mosaic(x, w, group_sizes, tile=TILE, interpret=True)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    ref = grouped_matmul_reference(x, w, group_sizes, fmt="bf16")
    _check(out, ref, group_sizes, atol=3e-2)


def test_fused_swiglu_f32_out_short_m():
    # M = 45 < block_m (x is padded to one tile), a group of 1 row, an empty last group.
    m, inter = 45, 64
    group_sizes = jnp.array([30, 1, 9, 0], jnp.int32)
    x, w = _data(1, m, 2 * inter, 4)
    tile = MosaicTileConfig(block_m=64, block_n=64, block_k=32, num_stages=2, epilogue_n=32,
                            grid_sms=2)
    out = grouped_matmul_mosaic(x, w, group_sizes, activation="silu", out_dtype=jnp.float32,
                                tile=tile, interpret=True)
    assert out.shape == (m, inter) and out.dtype == jnp.float32
    ref = grouped_matmul_reference(x, w, group_sizes, fmt="bf16", activation="silu")
    _check(out, ref, group_sizes, atol=2e-3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(k=80), "multiple of block_k"),  # K % 32 (GMEM tiled like SMEM)
        (dict(n=100), "multiple of 8"),
        (dict(n=64), "less than block_n"),
        (dict(x_dtype=jnp.float32), "bf16 only"),
        (dict(activation="silu", gate_up_layout="interleaved"), "concatenated"),
    ],
)
def test_unsupported_raise(kwargs, match):
    k, n = kwargs.pop("k", K), kwargs.pop("n", 136)
    x = jnp.ones((8, k), kwargs.pop("x_dtype", jnp.bfloat16))
    w = jnp.ones((2, 2 * n if "activation" in kwargs else n, k), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=match):
        grouped_matmul_mosaic(x, w, jnp.array([3, 5], jnp.int32), tile=TILE, interpret=True,
                              **kwargs)


def test_config_validation_and_heuristic():
    for bad in (dict(block_m=32), dict(block_k=128), dict(num_stages=1),
                dict(block_n=128, epilogue_n=128)):
        with pytest.raises(ValueError, match="MosaicTileConfig"):
            MosaicTileConfig(**bad)
    tile = choose_mosaic_tile_config(1536)
    assert (tile.block_m, tile.block_n) == (128, 256)
    assert tile.smem_bytes(1, 2) <= 227 * 1024
    fused = choose_mosaic_tile_config(768, fused_gate_up=True, out_itemsize=4)
    assert fused.block_n == 128 and fused.smem_bytes(2, 4) <= 227 * 1024
    assert choose_mosaic_tile_config(200).block_n == 128
    assert choose_mosaic_tile_config(1536, 2880).block_k == 64
    assert choose_mosaic_tile_config(1536, 96).block_k == 32
