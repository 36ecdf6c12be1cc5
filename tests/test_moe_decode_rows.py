"""The Mosaic decode path's f16 activation-row launches (``pallas_kernels.moe_decode.rows``)
against jnp (in the Triton interpreter on CPU, compiled on a GPU), and their sm_90 lowering."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._device import abstract_gpu
from pallas_kernels.grouped_matmul.config import Activation, GateUpLayout
from pallas_kernels.grouped_matmul.reference import GPT_OSS_ALPHA, rounded
from pallas_kernels.moe_decode.kernel import _epilogue, make_plan
from pallas_kernels.moe_decode.mosaic import fp4_operand_order
from pallas_kernels.moe_decode.rows import (
    PLAN_X_ROWS_MAX_PAIRS,
    h_rows,
    operand_source,
    plan_x_rows,
    row_warps,
    rows_reference,
    x_rows,
)
from tests.test_moe_decode_kernel import E, routing

# compiled on a GPU: XLA on the GPU may drop the interpreter's bf16 rounding of h (excess
# precision), a compiled Triton kernel keeps it
INTERPRET = jax.devices()[0].platform != "gpu"


def spread_rows(key, rows: int, cols: int) -> jax.Array:
    """Random rows whose scales span 1e-3 .. 1e3 (so the per-row factors differ)."""
    k1, k2 = jax.random.split(key)
    scale = 10.0 ** jax.random.uniform(k1, (rows, 1), minval=-3, maxval=3)
    return jax.random.normal(k2, (rows, cols)) * scale


@pytest.mark.parametrize("block_k", [64, 128])
def test_operand_source_is_the_fp4_operand_order(block_k):
    src = operand_source(np.arange(3 * block_k), block_k)
    for step in range(3):
        np.testing.assert_array_equal(src[step * block_k:(step + 1) * block_k],
                                      step * block_k + fp4_operand_order(block_k))


@pytest.mark.parametrize("block_k", [None, 64, 128])
@pytest.mark.parametrize("p,h", [(1, 256), (8, 384), (21, 640)])
def test_x_rows(block_k, p, h):
    """Row r: token token_of_row[r]'s row (rows past P: token 0's), f16 times the factor equal
    to the bf16 row; the FP4 operand order where asked. H not a power of two."""
    t = 5
    x = spread_rows(jax.random.key(p), t, h).astype(jnp.bfloat16)
    token = jax.random.randint(jax.random.key(h), (p,), 0, t, jnp.int32)
    rows = p + 16
    a, factor = x_rows(x, token, rows, block_k=block_k, interpret=INTERPRET)
    full = jnp.concatenate([token, jnp.zeros(rows - p, jnp.int32)])
    want_a, want_f = rows_reference(x[full].astype(jnp.float32), block_k)
    np.testing.assert_array_equal(a, want_a)
    np.testing.assert_array_equal(factor, want_f)
    back = a.astype(jnp.float32) * factor[:, None]
    if block_k is not None:
        back = back[:, np.argsort(operand_source(np.arange(h), block_k))]
    np.testing.assert_array_equal(back, x[full].astype(jnp.float32))  # exact for bf16 rows


def check_plan_x_rows(ids, *, num_experts: int = E, rows: int | None = None,
                      block_k: int | None = None):
    """plan_x_rows, one launch: make_plan's Pallas plan (work, rows, items; its pairwise program
    up to 32 pairs, the radix sort past that) and x_rows of its token_of_row (rows past the
    pairs: token 0's), bit for bit; ``rows`` default: the pairs + 16."""
    t, k = ids.shape
    rows = t * k + 16 if rows is None else rows
    x = spread_rows(jax.random.key(t), t, 256).astype(jnp.bfloat16)
    plan, (a, factor) = plan_x_rows(x, ids, num_experts, rows, item_rows=16, block_k=block_k,
                                    interpret=INTERPRET)
    want = make_plan(ids, num_experts, pallas=True, interpret=INTERPRET, item_rows=16)
    for name in ("work", "token_of_row", "row_of_pair", "routed", "items"):
        np.testing.assert_array_equal(getattr(plan, name), getattr(want, name), err_msg=name)
    want_a, want_f = x_rows(x, want.token_of_row, rows, block_k=block_k, interpret=INTERPRET)
    np.testing.assert_array_equal(a, want_a)
    np.testing.assert_array_equal(factor, want_f)
    return want


@pytest.mark.parametrize("pattern", ["random", "repeated", "zero_experts", "all_zero",
                                     "dup_in_token"])
@pytest.mark.parametrize("t,k,block_k", [(1, 4, None), (3, 3, 64), (4, 8, 128), (6, 6, 64),
                                         (10, 6, None)])  # 36, 60 pairs: the radix plan
def test_plan_x_rows_is_the_plan_and_the_x_rows(pattern, t, k, block_k):
    check_plan_x_rows(routing(pattern, t, k), block_k=block_k)


@pytest.mark.parametrize("t,k", [(21, 3), (64, 1)])
def test_plan_x_rows_runs_of_several_items(t, k):
    """Runs of 21 / 64 rows on expert 3 (2 / 4 work items of 16 rows); at 21 x 3 each token's
    second slot a zero expert, its third random."""
    ids = np.array(routing("one_expert", t, k))
    if k > 1:
        ids[:, 1] = E
    check_plan_x_rows(jnp.asarray(ids), block_k=128)


def test_plan_x_rows_as_many_items_as_rows():
    """20 pairs on 20 distinct experts of 128 in 20 rows: 20 work items, one a row (the bound
    min(U + cdiv(P, 16), P) at P), every row program writing one."""
    ids = jnp.asarray(np.random.default_rng(1).permutation(128)[:20, None], jnp.int32)
    want = check_plan_x_rows(ids, num_experts=128, rows=20)
    assert want.items.shape[1] == 20


def test_row_warps():
    """4 warps up to 2048-wide rows (Qwen3's H and I), 8 from 4096 padded (gpt-oss's 2880,
    DeepSeek-V3's 7168)."""
    assert [row_warps(k) for k in (160, 768, 2048, 2880, 4096, 7168, 16384)] == [4, 4, 4, 8, 8,
                                                                                   8, 8]


def test_plan_x_rows_bad_sizes_raise():
    x = jnp.ones((5, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=f"at most {PLAN_X_ROWS_MAX_PAIRS}"):
        plan_x_rows(x, jnp.zeros((9, 8), jnp.int32), E, 88, item_rows=16, interpret=True)
    with pytest.raises(ValueError, match="rows for"):
        plan_x_rows(x, jnp.zeros((2, 8), jnp.int32), E, 8, item_rows=16, interpret=True)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("layout,activation,limit,block_k", [
    (GateUpLayout.CONCATENATED, Activation.SILU, None, None),
    (GateUpLayout.CONCATENATED, Activation.SILU, 0.5, 128),  # DeepSeek-V4 clamp
    (GateUpLayout.INTERLEAVED, Activation.GPT_OSS, 7.0, 64),  # gpt-oss
])
def test_h_rows(splits, layout, activation, limit, block_k):
    """h row r: the partials of row r summed, ``act(gate) * up`` rounded to bf16, then scaled
    like x (and ordered for FP4)."""
    rows, inter = 24, 384  # not a power of two
    gu = spread_rows(jax.random.key(splits), splits * rows, 2 * inter)
    h, h_factor = h_rows(gu, splits=splits, activation=activation, layout=layout, limit=limit,
                         block_k=block_k, interpret=INTERPRET)
    total = gu[:rows]
    for s in range(1, splits):
        total = total + gu[s * rows:(s + 1) * rows]
    if layout is GateUpLayout.INTERLEAVED:
        gate, up = total[:, 0::2], total[:, 1::2]
    else:
        gate, up = total[:, :inter], total[:, inter:]
    want = rounded(_epilogue(gate, up, activation, limit, GPT_OSS_ALPHA), jnp.bfloat16)
    want_h, want_f = rows_reference(want, block_k)
    np.testing.assert_array_equal(h_factor, want_f)
    np.testing.assert_allclose(h.astype(jnp.float32), want_h.astype(jnp.float32), rtol=8e-3,
                               atol=0)  # one bf16 ulp where the activation's last bit differs
    assert np.mean(np.asarray(h) == np.asarray(want_h)) > 0.99


@pytest.mark.parametrize("fp4", [False, True])
def test_rows_lower_to_triton_for_h200(fp4):
    """The launches lowered by Pallas' Triton backend for the H200 without a GPU (Qwen3 and
    gpt-oss widths: H 2048 / 2880, I 768 / 2880)."""
    sd = jax.ShapeDtypeStruct
    for h, inter, layout in ((2048, 768, GateUpLayout.CONCATENATED),
                             (2880, 2880, GateUpLayout.INTERLEAVED)):
        bk = (128 if h % 128 == 0 else 64) if fp4 else None

        def f(x, token, gu, h=h, inter=inter, layout=layout, bk=bk):
            a, factor = x_rows(x, token, 88, block_k=bk)
            _, (a1, _) = plan_x_rows(x, token[:32].reshape(4, 8), 128, 40, item_rows=16,
                                     block_k=bk)
            _, (a2, _) = plan_x_rows(x, token.reshape(8, 8), 128, 88, item_rows=16,
                                     block_k=bk)  # the radix plan's program
            return a, a1, a2, h_rows(gu, splits=2, layout=layout, activation=Activation.GPT_OSS,
                                 limit=7.0, block_k=bk)

        with abstract_gpu():
            lowered = jax.jit(functools.partial(f)).trace(
                sd((8, h), jnp.bfloat16), sd((64,), jnp.int32),
                sd((176, 2 * inter), jnp.float32)).lower(lowering_platforms=("cuda",))
        assert lowered.as_text().count("__gpu$xla.gpu.triton") == 4


def test_h_rows_bad_shapes_raise():
    with pytest.raises(ValueError, match=r"expected gu \[2 \* R, 2I\]"):
        h_rows(jnp.ones((9, 256)), splits=2, interpret=True)
    with pytest.raises(ValueError, match=r"expected gu"):
        h_rows(jnp.ones((8, 255)), interpret=True)


def test_round_to_bf16_is_the_cast():
    """The integer rounding h_rows uses equals f32 -> bf16 -> f32 (ties to even, subnormals,
    overflow to inf, inf); NaN stays NaN."""
    from pallas_kernels.moe_decode.rows import _round_to_bf16

    n = 100_000
    mag = 10.0 ** jax.random.uniform(jax.random.key(1), (n,), minval=-40, maxval=38)
    v = jnp.concatenate([jax.random.normal(jax.random.key(0), (n,)) * mag, jnp.array(
        [0.0, -0.0, jnp.inf, -jnp.inf, 3.3895314e38, 1 + 2**-8, 1 + 3 * 2**-8, 1e-40, -1e-40])])
    np.testing.assert_array_equal(_round_to_bf16(v), v.astype(jnp.bfloat16).astype(jnp.float32))
    nan = jax.lax.bitcast_convert_type(jnp.array([0x7FFFFFFF, -1, 0x7FC00000], jnp.int32),
                                       jnp.float32)  # payloads that would carry into the sign
    assert np.isnan(np.asarray(_round_to_bf16(nan))).all()
