"""Paged-attention decode over FP8 KV pages on the Mosaic GPU Pallas backend (Hopper, sm_90):
e4m3 tensor-core dots that read the cached bytes as they are.

Why. The Triton decode kernel (``decode.py``) converts the e4m3 K and V tiles to f16 for its
dots, and V ``[T, D]`` (D contiguous) is the dot's B operand contracted over T: Triton reaches
that operand's layout by reading bytes one at a time, which held FP8 decode near 1.17x the
BF16 kernel's speed at 16k context on the H200 (half the bytes). Here nothing is converted:

- ``S^T = K Q^T``: A = the K tile ``[64 tokens, D]`` e4m3 straight from SMEM (TMA, one box a
  page), B = the query rows as two e4m3 terms ``[hi; lo]`` (``q * 2^u = hi + lo``: 8
  significant bits, the precision of a bf16 query), so the accumulator ``[64, 2R]`` holds
  both halves and ``S = (acc[:, :R] + acc[:, R:]) * 2^-u`` (a thread owns both).
- ``O^T = V^T P^T``: A = ``V^T [D, 64 tokens]`` e4m3 in registers, built by each thread from
  sixteen 32-bit SMEM loads (four D values of a token each) and 4x4 byte transposes
  (``prmt``): a thread's four D rows are four consecutive D, so its operand rows are the D
  axis in a fixed permuted order, undone by the output store. B = the probabilities
  ``[hi; lo]`` in e4m3, written to SMEM by each thread as bytes, in the token order the V
  operand uses (``token_of_k``; chosen so the V loads of a warp meet no SMEM bank twice).
- The softmax runs over the wgmma's M (tokens, across the 4 warps): per step one max per
  query row through warp shuffles and SMEM. The per-token FP8 scales: K's multiply the
  logits' rows, V's join the probabilities as ``2^(log2 s)`` under a second running max
  (``mv``), so the e4m3 probabilities use their range whatever the scales.

Grid ``(Hk, S, B)`` (kv head fastest), one warpgroup a program: all ``R = Q * G`` query rows
of one kv head (GQA packing), split ``s`` of sequence ``b``'s 64-token steps (as the Triton
kernel cuts them). K and V pages come by TMA, ``num_stages`` steps in flight; the page ids of
a step are read from the block table in GMEM. Each program writes its normalized partial
``o`` and log-sum-exp, combined (with the sinks) by ``decode.combine`` as the Triton path's
splits are. Splits (``choose_splits``): whole waves of ``RESIDENT_PROGRAMS`` programs an SM
(of tied counts, the fewest where their wave is nearly full).

Limits (``unsupported_reason``): FP8 pages, head_dim 128, page size 8 / 16 / 32 / 64, ``R <=
64``, no logit softcap; everything else (sliding window, sinks, Q = 1..4, ragged lengths)
as ``decode.paged_decode``. The kernel runs compiled on an sm_90 GPU only: its register-level
blocks (``inline_mgpu``) have no interpreter. Error against the float32 reference: 1.8e-3
relative on the H200 (a jnp statement of the same arithmetic: 5.6e-4; one term of e4m3
alone would be ~4e-2). Measured (H200, ``benchmarks/paged_attention_mosaic.py``): B 32 16k
32/4 heads 167 us, 0.79 of HBM, 1.66x the BF16 kernel's tokens/s and 1.45x the Triton FP8
kernel; 1.08-1.18x that kernel at B 1..32 elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, vector

from pallas_kernels._mgpu import f32 as _f32
from pallas_kernels._mgpu import gep as _gep
from pallas_kernels._mgpu import i32 as _i32
from pallas_kernels._mgpu import load as _load
from pallas_kernels._mgpu import thread_rows as _thread_rows
from pallas_kernels.paged_attention import decode as dec
from pallas_kernels.paged_attention.config import KVDtype, wave_splits

T = 64  # tokens a step: the S^T wgmma's M, the O^T wgmma's K
HEAD_DIM = 128  # the one head_dim (a K / V row is one 128-byte swizzled SMEM row)
MAX_ROWS = 64  # query rows R a program (N = 2R <= 128 of the S^T wgmma)
# The most query rows "auto" takes this kernel for: past 32 it spills registers and lost to the
# Triton FP8 kernel 3-5x (H100 SXM, B 32 16k, 64/4 heads: R 48 0.32x, R 64 0.21x; 32/4 heads:
# R 24 1.2x, R 32 1.02x; NOTES session 37; 3 splits). With whole-wave splits (2 at B 32, 8 at
# B 8): R 16 1.01-1.02x, R 24 1.55x (session 38). "mosaic" still runs up to MAX_ROWS.
AUTO_MAX_ROWS = 32
# Programs an SM the splits plan for: two fit by registers at R 16-32 (181-254 a thread, one
# warpgroup; offline ptxas, NOTES session 37); at R 8 (128) 2 splits still beat 3.
# Splits that fill whole waves of 2 an SM: H100 SXM, B 32 16k 4 kv heads, R 8 / 16 / 24 / 32
# 3 -> 2 splits 219 -> 214 / 283 -> 225 / 326 -> 248 / 393 -> 294 us; B 8 R 16 9 -> 8 splits
# 92 -> 71 us (NOTES session 38).
RESIDENT_PROGRAMS = 2
PAGE_SIZES = (8, 16, 32, 64)
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
P_SHIFT = 8  # probabilities enter the e4m3 operand times 2^8 (<= 256 < 448)


@dataclasses.dataclass(frozen=True)
class _Static:
    num_kv_heads: int
    group: int
    q_len: int
    page_size: int
    max_pages: int
    num_splits: int
    num_stages: int
    sliding_window: int | None

    @property
    def rows(self) -> int:  # query rows a program
        return self.q_len * self.group

    @property
    def rows_pad(self) -> int:  # R: a multiple of 8 (column r and r + R in one thread)
        return -(-self.rows // 8) * 8


# ---------------------------------------------------------------------------------------------
# Token order of the O^T dot's K axis.
# ---------------------------------------------------------------------------------------------


def token_of_k(k):
    """The token (within a 64-token step) at position ``k`` of the V^T / P^T operands.

    In the 8-bit wgmma A layout thread ``c`` of a quad holds K columns ``16 kb + 4c + e``
    (e = 0..3) of each 16-column block kb; it loads the tokens ``16 kb + 8 (e // 2) + 2c + e %
    2``: in one load instruction the quads' tokens differ in ``t % 8 = 2c + e % 2``, which
    the 128-byte swizzle turns into distinct banks."""
    kb, rest = k // 16, k % 16
    c, e = rest // 4, rest % 4
    return 16 * kb + 8 * (e // 2) + 2 * c + e % 2


def k_of_token(t):
    """Inverse of ``token_of_k``."""
    kb, rest = t // 16, t % 16
    return 16 * kb + 4 * ((rest % 8) // 2) + 2 * (rest // 8) + rest % 2


# ---------------------------------------------------------------------------------------------
# Queries as two e4m3 terms (XLA, before the launch).
# ---------------------------------------------------------------------------------------------


def _e4m3_terms(x):
    """``x`` f32 (``|x| < 240``) -> ``(hi, lo)`` e4m3 with ``hi + lo ~ x`` to 8 significant
    bits (``lo`` rounds the remainder ``x - hi``). ``hi`` is rounded by ``reduce_precision``
    (e4m3 below 240): the round trip ``x.astype(e4m3).astype(f32)`` is one XLA on the GPU may
    drop (excess precision allowed), which left ``lo = 0`` (measured: 4% error on the H200)."""
    hi = lax.reduce_precision(x, exponent_bits=4, mantissa_bits=3)
    return hi.astype(jnp.float8_e4m3fn), (x - hi).astype(jnp.float8_e4m3fn)


def query_terms(q, *, group: int, rows_pad: int, scale: float):
    """``q [B, Q, Hq, D]`` -> ``(qcat [B, Hk, 2R, D] e4m3, qinv [B, Hk, R] f32)``: row ``r =
    i * G + g`` of kv head h is query token i's head ``h * G + g`` times ``2^u`` (per row: its
    amax in [64, 128)), split into ``hi`` (rows ``[0, R)``) and ``lo`` (rows ``[R, 2R)``);
    ``qinv = scale * log2(e) * 2^-u`` turns the dots into base-2 logits. Padding rows are 0."""
    b, nq, hq, d = q.shape
    hk = hq // group
    x = q.astype(jnp.float32).reshape(b, nq, hk, group, d).transpose(0, 2, 1, 3, 4)
    x = x.reshape(b, hk, nq * group, d)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, rows_pad - nq * group), (0, 0)))
    _, e = jnp.frexp(jnp.max(jnp.abs(x), axis=-1))  # amax in [2^(e-1), 2^e)
    u = jnp.clip(7 - e, -100, 100).astype(jnp.int32)
    hi, lo = _e4m3_terms(jnp.ldexp(x, u[..., None]))
    qinv = jnp.ldexp(jnp.float32(scale * LOG2E), -u)
    return jnp.concatenate([hi, lo], axis=2), qinv


# ---------------------------------------------------------------------------------------------
# Inline Mosaic GPU blocks (the register-level parts).
# ---------------------------------------------------------------------------------------------


def _ptx(text, *args, ty=None):
    return mgpu.utils.inline_ptx(text, *args, result_types=ty or ir.F32Type.get())


def _exp2(x):
    return _ptx("ex2.approx.ftz.f32 $0, $1;", x)


def _log2(x):
    return _ptx("lg2.approx.ftz.f32 $0, $1;", x)


def _lane(vec, i):
    return vector.extract(vec, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))


def _pair(a, b):
    return vector.from_elements(ir.VectorType.get((2,), ir.F32Type.get()), [a, b])


def _select(cond, a, b):
    return arith.select(cond, a, b)


def _lt(a, b):
    return arith.cmpi(arith.CmpIPredicate.slt, a, b)


def _is_neg_inf(x):
    return arith.cmpf(arith.CmpFPredicate.OEQ, x, _f32(-math.inf))


def _wgmma_regs(shape):
    return np.empty(mgpu.WGMMA_LAYOUT.registers_shape(shape), object)


def _wgmma_array(regs):
    return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)


def _reg(arr, j, i):
    """Register (vector<2>) of column block ``j``, row half ``i`` of a [64, N] WGMMA array."""
    return arr.registers[0, j, 0, 0, i, 0, 0, 0, 0]


def _wg_f32(shape):
    return plgpu.ShapeDtypeStruct(shape, jnp.float32, layout=plgpu.Layout.WGMMA)


def _step_scales(bt_ref, ks_ref, vs_ref, b, h, t0, lo, hi, *, st: _Static):
    """The FP8 scales of the thread's two token rows of the step starting at position ``t0``:
    a ``[64, 8]`` f32 WGMMA carrier (register of row half i = (k scale, v scale); 0 for a
    token outside ``[lo, hi)``). Called a step ahead: the two dependent global loads (page id,
    then scale) leave the critical path."""
    p, hk, pt = st.page_size, st.num_kv_heads, st.max_pages

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(),
                                  *(plgpu.Layout.WG_SPLAT,) * 5),
                       return_type=_wg_f32((T, 8)))
    def load(_, bt, ks, vs, b, h, t0, lo, hi):
        f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
        row, *_ = _thread_rows()
        b, h, t0, lo, hi = (v.registers.item() for v in (b, h, t0, lo, hi))
        bt_ptr, ks_ptr, vs_ptr = (mgpu.utils.memref_ptr(r) for r in (bt, ks, vs))
        regs = _wgmma_regs((T, 8))
        for i in range(2):
            pos = arith.addi(t0, arith.addi(row, _i32(8 * i)))
            ok = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, pos, lo), _lt(pos, hi))
            pidx = _select(ok, arith.divsi(pos, _i32(p)), _i32(0))
            page = _load(bt_ptr, arith.muli(arith.addi(arith.muli(b, _i32(pt)), pidx),
                                            _i32(4)), i32)
            at = arith.addi(arith.muli(arith.addi(arith.muli(page, _i32(p)),
                                                  arith.remsi(pos, _i32(p))), _i32(hk)), h)
            at = arith.muli(_select(ok, at, _i32(0)), _i32(4))
            k_s = _select(ok, _load(ks_ptr, at, f32), _f32(0.0))
            v_s = _select(ok, _load(vs_ptr, at, f32), _f32(0.0))
            regs[0, 0, 0, 0, i, 0, 0, 0, 0] = _pair(k_s, v_s)
        return _wgmma_array(regs)

    return load(bt_ref, ks_ref, vs_ref, *(jnp.asarray(v, jnp.int32)
                                          for v in (b, h, t0, lo, hi)))


def _column_values(qinv_ref, base, *, st: _Static):
    """``qinv`` of the thread's columns (row r of the program's query block) as a ``[64, R]``
    WGMMA array (both row halves the same)."""
    rp = st.rows_pad

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT),
                       return_type=_wg_f32((T, rp)))
    def load(_, ref, base):
        f32 = ir.F32Type.get()
        *_, c = _thread_rows()
        ptr = mgpu.utils.memref_ptr(ref)
        regs = _wgmma_regs((T, rp))
        for j in range(rp // 8):
            r = arith.addi(_i32(8 * j), arith.muli(c, _i32(2)))
            at = arith.muli(arith.addi(base.registers.item(), r), _i32(4))
            pair = llvm.load(ir.VectorType.get((2,), f32), _gep(ptr, at))
            for i in range(2):
                regs[0, j, 0, 0, i, 0, 0, 0, 0] = pair
        return _wgmma_array(regs)

    return load(qinv_ref, jnp.asarray(base, jnp.int32))


def _reduce_over_tokens(values, red_ptr, warp, g, c, *, rp: int, op):
    """``values[(q, j, v)]`` (per thread: ``op`` over its two rows) -> ``op`` (max or add) over
    all 64 token rows: warp shuffles over the row groups, then the 4 warps through SMEM
    (``red`` ``[4, len(quantities), R]`` f32 of this step's parity)."""
    out = {}
    for key, x in values.items():
        for dist in (4, 8, 16):
            x = op(x, mgpu.utils.shfl_bfly(x, dist))
        out[key] = x
    nq = 1 + max(q for q, _, _ in values)

    def at(w, q, j, v):
        r = arith.addi(_i32(8 * j + v), arith.muli(c, _i32(2)))
        return arith.muli(arith.addi(arith.muli(arith.addi(arith.muli(w, _i32(nq)), _i32(q)),
                                                _i32(rp)), r), _i32(4))

    is_first = arith.cmpi(arith.CmpIPredicate.eq, g, _i32(0))
    with mgpu.utils.when(is_first):
        for (q, j, v), x in out.items():
            llvm.store(x, _gep(red_ptr, at(warp, q, j, v)))
    mgpu.utils.warpgroup_barrier()
    f32 = ir.F32Type.get()
    for (q, j, v) in out:
        x = _load(red_ptr, at(_i32(0), q, j, v), f32)
        for w in range(1, 4):
            x = op(x, _load(red_ptr, at(_i32(w), q, j, v), f32))
        out[q, j, v] = x
    return out


def _p_offset(n, k):
    """Byte of element (n, k) of the P^T tile ``[2R, 64]`` e4m3 (tiles of 8 rows, 64-byte
    swizzle)."""
    t = arith.addi(arith.muli(arith.remui(n, _i32(8)), _i32(64)), k)
    chunk = arith.remui(arith.shrui(t, _i32(7)), _i32(4))
    t = arith.xori(t, arith.shli(chunk, _i32(4)))
    return arith.addi(arith.muli(arith.divui(n, _i32(8)), _i32(512)), t)


def _softmax_step(s_acc, scales, qinv, m, mv, l, red_ref, parity, p_ref, t0, lo, seq_len, *,
                  st: _Static):
    """One step's online softmax on the S^T accumulator ``[64, 2R]``: the logits of the
    thread's (token, query row) pairs, masked; the running maxima ``m`` (logits) and ``mv``
    (logits + log2 of the V scale) over all tokens; ``l`` (per thread and row half); the
    probabilities ``2^(lv - mv) * 2^8`` as e4m3 ``hi`` and ``lo`` bytes into the P^T tile
    (rows r and R + r, column ``k_of_token``), committed for the wgmma. Returns ``(m, mv, l,
    alpha)``, alpha ``[64, 2R]`` the O^T accumulator's rescale (both halves)."""
    rp, g_size, nq, w_size = st.rows_pad, st.group, st.q_len, st.sliding_window
    rows = st.rows
    ret = (_wg_f32((T, rp)), _wg_f32((T, rp)), _wg_f32((T, rp)), _wg_f32((T, 2 * rp)))

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,) * 6 + (
        plgpu.RefType(), plgpu.Layout.WG_SPLAT, plgpu.RefType(_p_transforms()),
        plgpu.Layout.WG_SPLAT, plgpu.Layout.WG_SPLAT, plgpu.Layout.WG_SPLAT), return_type=ret)
    def step(_, s_acc, scales, qinv, m, mv, l, red, parity, p_tile, t0, lo, seq_len):
        i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
        row, warp, g, c = _thread_rows()
        t0, lo, seq_len, parity = (v.registers.item() for v in (t0, lo, seq_len, parity))
        red_ptr = _gep(mgpu.utils.memref_ptr(red), arith.muli(parity, _i32(4 * 2 * rp * 4)))
        neg_inf = _f32(-math.inf)
        logit, lv, step_max = {}, {}, {}
        for j in range(rp // 8):
            for v in range(2):
                r = arith.addi(_i32(8 * j + v), arith.muli(c, _i32(2)))  # query row
                q_pos = arith.addi(arith.subi(seq_len, _i32(nq)), arith.divui(r, _i32(g_size)))
                col_ok = _lt(r, _i32(rows))
                for i in range(2):
                    sc = _reg(scales, 0, i)
                    tok = arith.addi(t0, arith.addi(row, _i32(8 * i)))
                    ok = arith.andi(col_ok, arith.andi(
                        arith.cmpi(arith.CmpIPredicate.sge, tok, lo),
                        arith.cmpi(arith.CmpIPredicate.sle, tok, q_pos)))
                    if w_size is not None:
                        ok = arith.andi(ok, arith.cmpi(arith.CmpIPredicate.sgt, tok,
                                                       arith.subi(q_pos, _i32(w_size))))
                    dot = arith.addf(_lane(_reg(s_acc, j, i), v),
                                     _lane(_reg(s_acc, j + rp // 8, i), v))
                    x = arith.mulf(arith.mulf(dot, _lane(_reg(qinv, j, i), v)), _lane(sc, 0))
                    logit[j, v, i] = _select(ok, x, neg_inf)
                    lv[j, v, i] = _select(ok, arith.addf(x, _log2(_lane(sc, 1))), neg_inf)
                step_max[0, j, v] = arith.maximumf(logit[j, v, 0], logit[j, v, 1])
                step_max[1, j, v] = arith.maximumf(lv[j, v, 0], lv[j, v, 1])
        step_max = _reduce_over_tokens(step_max, red_ptr, warp, g, c, rp=rp, op=arith.maximumf)

        p_ptr = mgpu.utils.memref_ptr(p_tile)
        regs = {name: _wgmma_regs((T, rp)) for name in ("m", "mv", "l")}
        alpha_regs = _wgmma_regs((T, 2 * rp))
        for j in range(rp // 8):
            new = {}
            for name, old, q in (("m", m, 0), ("mv", mv, 1)):
                pair = []
                for v in range(2):
                    o = _lane(_reg(old, j, 0), v)
                    n = arith.maximumf(o, step_max[q, j, v])
                    safe = _select(_is_neg_inf(n), _f32(0.0), n)
                    pair.append((o, n, safe))
                new[name] = pair
                vec = _pair(pair[0][1], pair[1][1])
                for i in range(2):
                    regs[name][0, j, 0, 0, i, 0, 0, 0, 0] = vec
            alpha_l = [_exp2(arith.subf(o, s)) for o, _, s in new["m"]]  # 0 from -inf
            alpha_v = _pair(*[_exp2(arith.subf(o, s)) for o, _, s in new["mv"]])
            for i in range(2):
                alpha_regs[0, j, 0, 0, i, 0, 0, 0, 0] = alpha_v
                alpha_regs[0, j + rp // 8, 0, 0, i, 0, 0, 0, 0] = alpha_v
            for i in range(2):
                tok = arith.addi(row, _i32(8 * i))  # within the step
                k = arith.addi(arith.muli(arith.divui(tok, _i32(16)), _i32(16)), arith.addi(
                    arith.muli(arith.divui(arith.remui(tok, _i32(8)), _i32(2)), _i32(4)),
                    arith.addi(arith.muli(arith.divui(arith.remui(tok, _i32(16)), _i32(8)),
                                          _i32(2)), arith.remui(tok, _i32(2)))))
                l_pair, pv = [], []
                for v in range(2):
                    p = _exp2(arith.subf(logit[j, v, i], new["m"][v][2]))
                    l_old = _lane(_reg(l, j, i), v)
                    l_pair.append(arith.addf(arith.mulf(l_old, alpha_l[v]), p))
                    pv.append(arith.mulf(_exp2(arith.subf(lv[j, v, i], new["mv"][v][2])),
                                         _f32(2.0**P_SHIFT)))
                regs["l"][0, j, 0, 0, i, 0, 0, 0, 0] = _pair(*l_pair)
                # e4m3 hi = pv rounded, lo = the remainder rounded: byte 0 -> v = 0
                hi = _ptx("cvt.rn.satfinite.e4m3x2.f32 $0, $1, $2;", pv[1], pv[0], ty=i16)
                back = _ptx("{ .reg .b32 h2; .reg .b16 a, b; cvt.rn.f16x2.e4m3x2 h2, $1; "
                            "mov.b32 {a, b}, h2; cvt.f32.f16 $0, a; }", hi)
                back1 = _ptx("{ .reg .b32 h2; .reg .b16 a, b; cvt.rn.f16x2.e4m3x2 h2, $1; "
                             "mov.b32 {a, b}, h2; cvt.f32.f16 $0, b; }", hi)
                lo_ = _ptx("cvt.rn.satfinite.e4m3x2.f32 $0, $1, $2;",
                           arith.subf(pv[1], back1), arith.subf(pv[0], back), ty=i16)
                for half, bits in ((0, hi), (rp, lo_)):
                    word = arith.extui(i32, bits)
                    for v in range(2):
                        byte = arith.trunci(ir.IntegerType.get_signless(8),
                                            arith.shrui(word, _i32(8 * v)))
                        n = arith.addi(_i32(half + 8 * j + v), arith.muli(c, _i32(2)))
                        llvm.store(byte, _gep(p_ptr, _p_offset(n, k)))
        mgpu.utils.commit_shared()  # the P^T tile, for the wgmma (async proxy)
        return (*(_wgmma_array(regs[name]) for name in ("m", "mv", "l")),
                _wgmma_array(alpha_regs))

    return step(s_acc, scales, qinv, m, mv, l, red_ref, jnp.asarray(parity, jnp.int32), p_ref,
                *(jnp.asarray(v, jnp.int32) for v in (t0, lo, seq_len)))


def _v_transposed(v_ref, t0, lo, hi):
    """The V tile ``[64 tokens, 128]`` e4m3 (128-byte swizzle) -> the two A operands ``[64 D
    rows, 64]`` (WGMMA_8BIT) of ``O^T = V^T P^T``: thread (w, g, c) loads word ``q = 8w + g``
    (D ``4q .. 4q + 3``) of its 16 tokens (``token_of_k``), zeroes tokens outside ``[lo, hi)``
    (never-written cache rows), and transposes each four tokens' words by ``prmt``: byte
    ``d`` of the word goes to operand ``d // 2``, row half ``d % 2``."""
    operand = plgpu.ShapeDtypeStruct((T, T), jnp.float8_e4m3fn, layout=plgpu.Layout.WGMMA_8BIT)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(_kv_transforms()), plgpu.Layout.WG_SPLAT,
                                  plgpu.Layout.WG_SPLAT, plgpu.Layout.WG_SPLAT),
                       return_type=(operand, operand))
    def build(_, ref, t0, lo, hi):
        i32 = ir.IntegerType.get_signless(32)
        f8x4 = ir.VectorType.get((4,), ir.Float8E4M3FNType.get())
        _, warp, g, c = _thread_rows()
        t0, lo, hi = (v.registers.item() for v in (t0, lo, hi))
        ptr = mgpu.utils.memref_ptr(ref)
        q = arith.addi(arith.muli(warp, _i32(8)), g)  # the thread's 32-bit word of a row
        regs = [np.empty(mgpu.WGMMA_LAYOUT_8BIT.registers_shape((T, T)), object)
                for _ in range(2)]
        for kb in range(4):
            words = []
            for e in range(4):
                tok = arith.addi(_i32(16 * kb + 8 * (e // 2) + e % 2), arith.muli(c, _i32(2)))
                # row tok of 128 bytes in 8-row tiles; 16-byte chunk XOR-ed with tok % 8
                chunk = arith.xori(arith.divui(q, _i32(4)), arith.remui(tok, _i32(8)))
                at = arith.addi(arith.muli(tok, _i32(128)), arith.addi(
                    arith.muli(chunk, _i32(16)), arith.muli(arith.remui(q, _i32(4)), _i32(4))))
                word = _load(ptr, at, i32)
                pos = arith.addi(t0, tok)
                ok = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, pos, lo), _lt(pos, hi))
                words.append(_select(ok, word, _i32(0)))

            def prmt(a, b, sel):
                return _ptx("prmt.b32 $0, $1, $2, $3;", a, b, _i32(sel), ty=i32)

            lo01, hi01 = prmt(words[0], words[1], 0x5140), prmt(words[0], words[1], 0x7362)
            lo23, hi23 = prmt(words[2], words[3], 0x5140), prmt(words[2], words[3], 0x7362)
            rows = (prmt(lo01, lo23, 0x5410), prmt(lo01, lo23, 0x7632),
                    prmt(hi01, hi23, 0x5410), prmt(hi01, hi23, 0x7632))
            for d, word in enumerate(rows):
                regs[d // 2][0, kb, 0, 0, d % 2, 0, 0, 0, 0] = mgpu.utils.bitcast(word, f8x4)
        return tuple(mgpu.FragmentedArray(_registers=r, _layout=mgpu.WGMMA_LAYOUT_8BIT,
                                          _is_signed=None) for r in regs)

    return build(v_ref, *(jnp.asarray(v, jnp.int32) for v in (t0, lo, hi)))


def _finish(o0, o1, m, mv, l, red_ref, parity, o_ref, lse_ref, base_row, *, st: _Static):
    """After the last step: ``l`` summed over all tokens, the partial rows ``o = (acc_hi +
    acc_lo) * 2^(mv - m - 8) / l`` stored to GMEM with the D order undone (a 16-byte store
    of D ``4q .. 4q + 3`` a column), and ``lse = (m + log2 l) ln 2`` (-inf: no key)."""
    rp, d = st.rows_pad, HEAD_DIM

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,) * 5 + (
        plgpu.RefType(), plgpu.Layout.WG_SPLAT, plgpu.RefType(), plgpu.RefType(),
        plgpu.Layout.WG_SPLAT))
    def finish(_, o0, o1, m, mv, l, red, parity, o_out, lse_out, base_row):
        f32 = ir.F32Type.get()
        _, warp, g, c = _thread_rows()
        parity, base_row = parity.registers.item(), base_row.registers.item()
        red_ptr = _gep(mgpu.utils.memref_ptr(red), arith.muli(parity, _i32(4 * 2 * rp * 4)))
        sums = {}
        for j in range(rp // 8):
            for v in range(2):
                sums[0, j, v] = arith.addf(_lane(_reg(l, j, 0), v), _lane(_reg(l, j, 1), v))
        sums = _reduce_over_tokens(sums, red_ptr, warp, g, c, rp=rp, op=arith.addf)
        o_ptr, lse_ptr = mgpu.utils.memref_ptr(o_out), mgpu.utils.memref_ptr(lse_out)
        word = arith.addi(arith.muli(warp, _i32(8)), g)
        vec4 = ir.VectorType.get((4,), f32)
        for j in range(rp // 8):
            for v in range(2):
                r = arith.addi(_i32(8 * j + v), arith.muli(c, _i32(2)))
                total = sums[0, j, v]
                mm, mmv = _lane(_reg(m, j, 0), v), _lane(_reg(mv, j, 0), v)
                seen = arith.cmpf(arith.CmpFPredicate.OGT, total, _f32(0.0))
                # 2^(mv - m - 8) / l, 0 where no key was seen
                factor = arith.divf(_exp2(arith.subf(arith.subf(mmv, mm), _f32(P_SHIFT))),
                                    _select(seen, total, _f32(1.0)))
                factor = _select(seen, factor, _f32(0.0))
                vals = []
                for acc in (o0, o1):
                    for i in range(2):
                        x = arith.addf(_lane(_reg(acc, j, i), v),
                                       _lane(_reg(acc, j + rp // 8, i), v))
                        vals.append(arith.mulf(x, factor))
                # vals: D 4q + (2 * tile + half), the order of the operand rows
                out_row = arith.addi(base_row, r)
                ok = _lt(r, _i32(st.rows))
                with mgpu.utils.when(ok):
                    at = arith.muli(arith.addi(arith.muli(out_row, _i32(d)),
                                               arith.muli(word, _i32(4))), _i32(4))
                    llvm.store(vector.from_elements(vec4, vals), _gep(o_ptr, at))
                lse = _select(seen, arith.mulf(arith.addf(mm, _log2(
                    _select(seen, total, _f32(1.0)))), _f32(LN2)), _f32(-math.inf))
                first = arith.andi(ok, arith.andi(
                    arith.cmpi(arith.CmpIPredicate.eq, warp, _i32(0)),
                    arith.cmpi(arith.CmpIPredicate.eq, g, _i32(0))))
                with mgpu.utils.when(first):
                    llvm.store(lse, _gep(lse_ptr, arith.muli(out_row, _i32(4))))
        return ()

    finish(o0, o1, m, mv, l, red_ref, jnp.asarray(parity, jnp.int32), o_ref, lse_ref,
           jnp.asarray(base_row, jnp.int32))


# ---------------------------------------------------------------------------------------------
# The kernel.
# ---------------------------------------------------------------------------------------------


def _kv_transforms():
    """K / V tiles ``[64, 128]`` e4m3 and the query rows ``[2R, 128]``: 8-row tiles, 128-byte
    swizzle (the wgmma's K-major operands; ``_v_transposed``'s loads assume it)."""
    return (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))


def _p_transforms():
    """The P^T tile ``[2R, 64]`` e4m3: 8-row tiles, 64-byte swizzle (``_p_offset``)."""
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))


def _kernel(seq_lens, block_tables, qcat, qinv, k_pages, k_scale, v_pages, v_scale,
            o_out, lse_out, q_smem, k_smem, v_smem, p_smem, red_smem, kv_bar, q_bar, *,
            st: _Static):
    h, split, b = lax.axis_index("h"), lax.axis_index("s"), lax.axis_index("b")
    p, rp, stages = st.page_size, st.rows_pad, st.num_stages
    pps = T // p
    seq_len = seq_lens[b]
    lo, hi, first_page, j0, j1 = dec.split_steps(
        seq_len, split, q_len=st.q_len, page_size=p, max_pages=st.max_pages,
        pages_per_step=pps, num_splits=st.num_splits, sliding_window=st.sliding_window)
    n = jnp.maximum(j1 - j0, 0)
    last_page = jnp.maximum(lax.div(hi + p - 1, p) - 1, 0)

    plgpu.copy_gmem_to_smem(qcat.at[b, h], q_smem, q_bar)

    def issue(jj, slot):
        """TMA of step ``j0 + jj``'s pages (ids past the end clamped to the last page, whose
        rows the kernel masks)."""
        for i in range(pps):
            idx = jnp.minimum(first_page + (j0 + jj) * pps + i, last_page)
            page = block_tables[b, idx]
            for src, dst in ((k_pages, k_smem), (v_pages, v_smem)):
                plgpu.copy_gmem_to_smem(src.at[page, :, h], dst.at[slot, pl.ds(i * p, p)],
                                        kv_bar.at[slot])

    for s in range(stages - 1):
        @pl.when(s < n)
        def _(s=s):
            issue(s, s)

    def t0_of(jj):
        return (first_page + (j0 + jj) * pps) * p

    def scales_of(jj):
        return _step_scales(block_tables, k_scale, v_scale, b, h, t0_of(jj), lo, hi, st=st)

    qinv_cols = _column_values(qinv, (b * st.num_kv_heads + h) * rp, st=st)
    plgpu.barrier_wait(q_bar)

    def body(jj, carry):
        o0, o1, m, mv, l, scales = carry
        slot = lax.rem(jj, stages)
        scales_next = scales_of(jnp.minimum(jj + 1, jnp.maximum(n - 1, 0)))
        plgpu.barrier_wait(kv_bar.at[slot])

        def s_dot(acc):
            plgpu.wgmma(acc, k_smem.at[slot], q_smem.transpose((1, 0)))
            return acc[...]

        s_acc = pl.run_scoped(s_dot, plgpu.ACC((T, 2 * rp), jnp.float32))
        t0 = t0_of(jj)
        m, mv, l, alpha = _softmax_step(s_acc, scales, qinv_cols, m, mv, l, red_smem,
                                        lax.rem(jj, 2), p_smem, t0, lo, seq_len, st=st)

        @pl.when(jj + stages - 1 < n)  # every thread is past step jj - 1: its slot is free
        def _():
            issue(jj + stages - 1, lax.rem(jj + stages - 1, stages))

        vt0, vt1 = _v_transposed(v_smem.at[slot], t0, lo, hi)

        def o_dot(acc0, acc1):
            plgpu.wgmma(acc0, vt0, p_smem.transpose((1, 0)))
            plgpu.wgmma(acc1, vt1, p_smem.transpose((1, 0)))
            return acc0[...], acc1[...]

        part0, part1 = pl.run_scoped(o_dot, plgpu.ACC((T, 2 * rp), jnp.float32),
                                     plgpu.ACC((T, 2 * rp), jnp.float32))
        return o0 * alpha + part0, o1 * alpha + part1, m, mv, l, scales_next

    def full(shape, value):
        return plgpu.layout_cast(jnp.full(shape, value, jnp.float32), plgpu.Layout.WGMMA)

    init = (full((T, 2 * rp), 0.0), full((T, 2 * rp), 0.0), full((T, rp), -jnp.inf),
            full((T, rp), -jnp.inf), full((T, rp), 0.0), scales_of(0))
    o0, o1, m, mv, l, _ = lax.fori_loop(0, n, body, init)
    base_row = ((b * st.num_kv_heads + h) * st.num_splits + split) * st.rows
    _finish(o0, o1, m, mv, l, red_smem, lax.rem(n, 2), o_out, lse_out, base_row, st=st)


def unsupported_reason(kv_dtype, head_dim: int, page_size: int, rows: int,
                       logit_softcap) -> str | None:
    """Why ``paged_decode_mosaic`` cannot run this case (None: it can)."""
    if KVDtype.coerce(kv_dtype) is not KVDtype.FP8:
        return f"kv_dtype {KVDtype.coerce(kv_dtype).value}: the Mosaic GPU kernel reads FP8 pages"
    if head_dim != HEAD_DIM:
        return f"head_dim {head_dim}: the Mosaic GPU kernel takes {HEAD_DIM}"
    if page_size not in PAGE_SIZES:
        return f"page_size {page_size}: the Mosaic GPU kernel takes {PAGE_SIZES}"
    if rows > MAX_ROWS:
        return f"Q * Hq / Hk = {rows} query rows a kv head: the Mosaic GPU kernel takes <= 64"
    if logit_softcap is not None:
        return "logit_softcap: not in the Mosaic GPU kernel"
    return None


def choose_splits(batch: int, num_kv_heads: int, max_pages: int, page_size: int,
                  sm_count: int) -> int:
    """Splits of each sequence: up to ~2 programs per SM, each split >= 4 steps, at the split
    count whose last wave of ``RESIDENT_PROGRAMS`` per SM is fullest; of tied counts whose
    waves are nearly full (``config.FULL_WAVE``) the fewest, else the most."""
    steps = -(-max_pages * page_size // T)
    return wave_splits(batch * num_kv_heads, sm_count, RESIDENT_PROGRAMS, steps // 4,
                       fewer_when_full=True)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "num_splits",
                                             "num_stages", "out_dtype"))
def paged_decode_mosaic(
    q: jax.Array,  # [B, Q, Hq, 128] bf16/f16/f32
    k_pages: jax.Array,  # [N, P, Hk, 128] e4m3
    v_pages: jax.Array,
    block_tables: jax.Array,  # [B, Pt] int32
    seq_lens: jax.Array,  # [B] int32
    *,
    k_scale: jax.Array,  # [N, P, Hk] f32
    v_scale: jax.Array,
    scale: float,
    sliding_window: int | None = None,
    sinks: jax.Array | None = None,  # [Hq] f32
    num_splits: int | None = None,
    num_stages: int = 4,
    out_dtype=None,
) -> jax.Array:  # [B, Q, Hq, 128]
    """``decode.paged_decode`` for FP8 pages on the compiled Mosaic GPU kernel (module
    docstring; an sm_90 GPU only, no interpret mode). Arguments and their checks as there;
    NotImplementedError for what ``unsupported_reason`` names. ``num_splits=None``:
    ``choose_splits``; ``num_stages``: 64-token steps of K and V in flight."""
    from pallas_kernels._device import device_sm_count

    n, p, hk, scales, out_dtype = dec.check_decode_inputs(
        q, k_pages, v_pages, block_tables, seq_lens, sinks, kv_dtype=KVDtype.FP8,
        scales=dict(k_scale=k_scale, v_scale=v_scale, k_global_scale=None,
                    v_global_scale=None),
        scale=scale, sliding_window=sliding_window, logit_softcap=None, out_dtype=out_dtype)
    b, nq, hq, d = q.shape
    group = hq // hk
    reason = unsupported_reason(KVDtype.FP8, d, p, nq * group, None)
    if reason is not None:
        raise NotImplementedError(reason)
    if n * p * hk >= 2**31:
        raise NotImplementedError(f"k_pages: {n * p * hk} rows exceed int32 scale offsets")
    if num_stages < 2:
        raise ValueError(f"num_stages: expected >= 2, got {num_stages!r}")
    if b == 0 or nq == 0 or block_tables.shape[1] == 0:
        return jnp.zeros(q.shape, out_dtype)
    if num_splits is None:
        num_splits = choose_splits(b, hk, block_tables.shape[1], p, device_sm_count() or 132)
    st = _Static(num_kv_heads=hk, group=group, q_len=nq, page_size=p,
                 max_pages=block_tables.shape[1], num_splits=num_splits,
                 num_stages=num_stages, sliding_window=sliding_window)
    rp = st.rows_pad
    qcat, qinv = query_terms(q, group=group, rows_pad=rp, scale=scale)
    parts = b * hk * num_splits * st.rows
    kernel = plgpu.kernel(
        functools.partial(_kernel, st=st),
        out_type=(jax.ShapeDtypeStruct((parts, d), jnp.float32),
                  jax.ShapeDtypeStruct((parts,), jnp.float32)),
        grid=(hk, num_splits, b),
        grid_names=("h", "s", "b"),
        scratch_types=[
            plgpu.SMEM((2 * rp, d), jnp.float8_e4m3fn, transforms=_kv_transforms()),
            plgpu.SMEM((num_stages, T, d), jnp.float8_e4m3fn, transforms=_kv_transforms()),
            plgpu.SMEM((num_stages, T, d), jnp.float8_e4m3fn, transforms=_kv_transforms()),
            plgpu.SMEM((2 * rp, T), jnp.float8_e4m3fn, transforms=_p_transforms()),
            plgpu.SMEM((2, 4, 2, rp), jnp.float32),
            plgpu.Barrier(num_arrivals=2 * (T // p), num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=1),
        ],
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    o, lse = kernel(seq_lens.astype(jnp.int32), block_tables.astype(jnp.int32), qcat,
                    qinv.reshape(-1), k_pages, scales["k_scale"], v_pages, scales["v_scale"])
    shape = dec.SplitShape(q_len=nq, num_q_heads=hq, num_kv_heads=hk, num_splits=num_splits,
                           head_dim=d)
    return dec.combine_pallas(o, lse, sinks, st=shape, batch=b, out_dtype=out_dtype,
                              interpret=False).reshape(b, nq, hq, d)
