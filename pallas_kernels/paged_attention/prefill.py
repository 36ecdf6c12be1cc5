"""Paged-attention prefill: flash attention over a paged KV cache, Pallas on the Triton lowering.

``q [B, S, Hq, D]`` holds queries at arbitrary positions ``q_pos [B, S]`` (a fresh prompt:
``arange(S)``; a chunk after a cached prefix: ``start + arange(S)``; ``-1``: a padding query,
output 0). Query ``(b, s)`` sees the keys ``t <= q_pos[b, s]`` of its sequence -- the cached
prefix and the causal part of its own chunk, whose K/V are already in the cache -- and with a
sliding window ``W`` only ``t > q_pos - W``. Layout and dtypes of the pages as in ``decode.py``:
the token at position ``t`` is row ``t % P`` of page ``block_tables[b, t // P]``.

Grid ``(Hk * G / Gp, ceil(S / block_q), B)``, kv head fastest. One program takes ``block_q``
consecutive queries and ``Gp`` query heads of one kv head (all ``G`` by default: GQA packing);
its query block is ``[R, D]`` with row ``r = i * Gp + g`` (query i, head g), ``R = block_q * Gp``
padded to a power of two >= 16. Query tiles run in reverse order, so the causal prompt's
longest tiles start first. The program walks its sequence's pages from the first one its
queries' window reaches to the last one they see (keys ``[lo, hi)``: ``hi = max q_pos + 1``,
``lo = min q_pos - W + 1``), ``pages_per_step`` pages a step, so a tile costs what it reads:
pages past the causal limit or wholly before the window are never touched. Each step gathers
the ``[T, D]`` K and V rows of its kv head, dequantizes them in registers (the FP8 / NVFP4
scheme of ``decode.py``, whose helpers this file shares: bf16 / f16 / f32 dot operands,
per-token factors on the logits' and the probabilities' columns, NVFP4 as even / odd column
halves) and runs the online softmax in f32, base 2.

Masking. The steps split into three loops by position: the leading steps that cross the
window's lower edge and the trailing steps that reach past the smallest query position are
masked (causal / window / padding per element, and the K/V loads themselves only for the keys
some row sees, so unread slots may hold NaN and unused table entries garbage); the steps in
between are seen whole by every row and run without any mask -- for a long prompt almost all
of them. Padding rows take part in those unmasked steps (q loaded as 0) and are zeroed at the
end, as are rows that see no key and have no sink.

The file reads top-down: the kernel body on refs (its K/V tile loader, query-block load, logits
and online-softmax steps are ``decode.py``'s), the ``pallas_call`` wrapper, the jitted public
entry.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._device import device_sm_count
from pallas_kernels.paged_attention.config import (
    HEAD_DIMS,
    KVDtype,
    PrefillConfig,
    choose_prefill_config,
)
from pallas_kernels.paged_attention.decode import (
    _Q_DTYPES,
    _check_options,
    _check_pages,
    _check_scales,
    _dot_nn,
    _expect_dtype,
    _expect_shape,
    _grid,
    _out_dtype,
    _page_views,
    _StaticKV,
    fold_sinks,
    init_carry,
    kernel_operands,
    load_kv_tile,
    load_q_block,
    online_softmax,
    probs_operand,
    step_logits,
)


@dataclasses.dataclass(frozen=True)
class _Static(_StaticKV):
    """Everything the kernel body specializes on (hashable)."""

    kv_dtype: KVDtype
    q_len: int  # S
    num_q_heads: int  # Hq
    num_kv_heads: int  # Hk
    group: int  # G = Hq // Hk
    heads: int  # Gp query heads of one program
    head_dim: int  # D
    page_size: int  # P
    max_pages: int  # Pt, block-table width
    block_q: int  # queries of one program
    rows: int  # R: block_q * Gp padded to a power of two >= 16
    pages_per_step: int
    scale: float
    sliding_window: int | None
    logit_softcap: float | None

    @property
    def num_q_tiles(self) -> int:
        return -(-self.q_len // self.block_q)


# ---------------------------------------------------------------------------------------------
# Kernel body.
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Kernel body.
# ---------------------------------------------------------------------------------------------


def paged_prefill_kernel(
    q_pos_ref,  # [B * S] int32, < 0: padding query
    block_tables_ref,  # [B * Pt] int32 (flattened; page ids read per step)
    q_ref,  # [B * S * Hq, D] bf16/f16/f32 (rows gathered per program)
    k_ref,  # [N * P * Hk, D] f32/bf16/e4m3 | [N * P * Hk, D // 2] u8 (NVFP4)
    k_scale_ref,  # FP8 [N * P * Hk] f32 | NVFP4 [N * P * Hk, D // 16] e4m3 | None
    k_global_ref,  # NVFP4 [N * P * Hk] f32 | None
    v_ref,  # as k_ref
    v_scale_ref,  # as k_scale_ref
    v_global_ref,  # as k_global_ref
    sinks_ref,  # [Hq] f32 | None
    o_ref,  # [B * S * Hq, D] out dtype
    *,
    st: _Static,
):
    hg, tile, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    nq, gp, d, p = st.q_len, st.heads, st.head_dim, st.page_size
    t_step, pps = st.tokens_per_step, st.pages_per_step
    nvfp4 = st.kv_dtype is KVDtype.NVFP4
    div, rem = jax.lax.div, jax.lax.rem  # non-negative operands: no floor fix-ups
    groups_per_kv = st.group // gp
    h = div(hg, groups_per_kv)  # kv head
    h0 = h * st.group + rem(hg, groups_per_kv) * gp  # first query head of this program
    tile = st.num_q_tiles - 1 - tile  # longest (causal) tiles first

    # ---- the query block: row r = i * Gp + g ----
    r = jnp.arange(st.rows, dtype=jnp.int32)
    qs = tile * st.block_q + div(r, gp)  # [R] query index in the chunk
    gi = rem(r, gp)  # [R] head within the program's heads
    row_in = (r < st.block_q * gp) & (qs < nq)  # [R] rows that exist in q / o
    q_pos = plgpu.load(q_pos_ref.at[b * nq + qs], mask=row_in, other=-1)  # [R]
    row_ok = q_pos >= 0  # [R] real queries
    q_rows = (b * nq + qs) * st.num_q_heads + h0 + gi  # [R] rows of q_ref / o_ref
    col = jnp.arange(d // 2 if nvfp4 else d, dtype=jnp.int32)
    col_sets = (2 * col, 2 * col + 1) if nvfp4 else (col,)
    # [R, D] | NVFP4 [R, D/2] x 2; padding rows 0
    q_halves, logit_rows = load_q_block(q_ref, q_rows, col_sets, row_ok, st.compute_dtype)

    # ---- the keys this tile reads: [lo, hi), and the steps that need no mask ----
    big = jnp.int32(2**30)
    p_min = jnp.min(jnp.where(row_ok, q_pos, big))  # big: no real query
    p_max = jnp.max(q_pos)  # -1: no real query
    hi = jnp.minimum(p_max + 1, st.max_pages * p)
    lo = jnp.int32(0)
    if st.sliding_window is not None:
        lo = jnp.clip(p_min - st.sliding_window + 1, 0, hi)
    first_page = div(lo, p)
    k_first = first_page * p
    num_pages = jnp.maximum(div(hi + p - 1, p) - first_page, 0)
    num_steps = div(num_pages + pps - 1, pps)
    # Unmasked steps [a, c): every key in them is seen by every real row.
    full = jnp.minimum(div(jnp.clip(p_min + 1 - k_first, 0, big), t_step), num_steps)
    a = jnp.int32(0)
    if st.sliding_window is not None:
        edge = jnp.maximum(p_max - st.sliding_window + 1 - k_first, 0)  # keys below: masked
        a = jnp.minimum(div(edge + t_step - 1, t_step), num_steps)
    c = jnp.maximum(full, a)

    tt = jnp.arange(t_step, dtype=jnp.int32)  # token within the step
    kv_row_in_page = rem(tt, p) * st.num_kv_heads + h  # [T]

    def step(j, carry, *, masked: bool):
        accs, m_prev, l_prev = carry
        page0 = first_page + j * pps
        pos = page0 * p + tt  # [T] key positions
        visible = seen = None
        if masked:
            visible = row_ok[:, None] & (pos[None, :] <= q_pos[:, None]) & (pos < hi)[None, :]
            if st.sliding_window is not None:
                visible &= pos[None, :] > (q_pos - st.sliding_window)[:, None]
            seen = jnp.max(visible.astype(jnp.int32), axis=0) > 0  # [T] read by some row
        page_ids = plgpu.load(
            block_tables_ref.at[b * st.max_pages + page0 + div(tt, p)],
            mask=seen,
            other=None if seen is None else 0,
        )  # [T] page id of each token
        rows = page_ids * (p * st.num_kv_heads) + kv_row_in_page  # [T] rows of k_ref / v_ref
        k_tiles, k_tok = load_kv_tile(st.kv_dtype, k_ref, k_scale_ref, k_global_ref, rows, seen)
        v_tiles, v_tok = load_kv_tile(st.kv_dtype, v_ref, v_scale_ref, v_global_ref, rows, seen)

        s = step_logits(q_halves, k_tiles, k_tok, logit_rows, st)  # [R, T] f32
        if masked:
            s = jnp.where(visible, s, -jnp.inf)

        m_next, alpha, probs, l_next = online_softmax(s, m_prev, l_prev)
        probs, step_scale = probs_operand(probs, v_tok, st.compute_dtype)
        new_accs = []
        for acc, vt in zip(accs, v_tiles, strict=True):
            pv = _dot_nn(probs, vt, st.precision)  # [R, D(/2)]
            new_accs.append(acc * alpha[:, None] + (pv if step_scale is None else pv * step_scale))
        return tuple(new_accs), m_next, l_next

    d_acc = d // 2 if nvfp4 else d
    carry = init_carry(st.rows, d_acc, len(q_halves))
    masked_step = functools.partial(step, masked=True)
    if st.sliding_window is not None:  # steps crossing the window's lower edge
        carry = jax.lax.fori_loop(0, a, masked_step, carry)
    carry = jax.lax.fori_loop(a, c, functools.partial(step, masked=False), carry)
    accs, m_i, l_i = jax.lax.fori_loop(c, num_steps, masked_step, carry)  # the diagonal

    if sinks_ref is not None:  # one extra logit per head, in the denominator only
        l_i, accs = fold_sinks(sinks_ref, h0 + gi, row_in, m_i, l_i, accs)
    ok = row_ok & (l_i > 0)  # padding rows and rows that saw nothing: 0
    inv_l = jnp.where(ok, 1.0 / jnp.where(ok, l_i, 1.0), 0.0)[:, None]
    # Rows past the chunk point past the end: the GPU skips them, the interpreter drops them.
    out_rows = jnp.where(row_in, q_rows, o_ref.shape[0])
    for acc, cols in zip(accs, col_sets, strict=True):
        out = (acc * inv_l).astype(o_ref.dtype)
        plgpu.store(o_ref.at[_grid(out_rows, cols)], out, mask=row_in[:, None])


# ---------------------------------------------------------------------------------------------
# pallas_call wrapper.
# ---------------------------------------------------------------------------------------------


def _paged_prefill_pallas(
    q_pos,  # [B, S] int32
    block_tables,  # [B, Pt] int32
    q,  # [B, S, Hq, D]
    k_pages,  # [N, P, Hk, D] | [N, P, Hk, D // 2] u8
    k_scale,  # FP8 [N, P, Hk] | NVFP4 [N, P, Hk, D // 16] | None
    k_global,  # NVFP4 [N, P, Hk] | None
    v_pages,
    v_scale,
    v_global,
    sinks,  # [Hq] f32 | None
    *,
    st: _Static,
    config: PrefillConfig,
    out_dtype,
    interpret: bool,
):
    b = q.shape[0]
    rows = q.shape[0] * q.shape[1] * q.shape[2]
    # No BlockSpecs, as in decode.py: every operand is passed whole (a pointer in Triton); the
    # pages a program reads come from the block table, its q / o rows are strided gathers of
    # the head group, and all reshapes below are free (row-major views).
    out = pl.pallas_call(
        functools.partial(paged_prefill_kernel, st=st),
        # kv head fastest: the programs of one query tile read the same pages side by side.
        grid=(st.num_kv_heads * (st.group // st.heads), st.num_q_tiles, b),
        out_shape=jax.ShapeDtypeStruct((rows, st.head_dim), out_dtype),
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name=(f"paged_prefill_{st.kv_dtype.value}_d{st.head_dim}_r{st.rows}_t{st.tokens_per_step}"),
    )(
        *kernel_operands(
            q_pos, block_tables, q, k_pages, k_scale, k_global, v_pages, v_scale, v_global, sinks
        )
    )
    return out.reshape(q.shape[:3] + (st.head_dim,))


# ---------------------------------------------------------------------------------------------
# Public entry.
# ---------------------------------------------------------------------------------------------


@functools.partial(
    jax.jit,
    static_argnames=(
        "kv_dtype",
        "scale",
        "sliding_window",
        "logit_softcap",
        "config",
        "out_dtype",
        "interpret",
    ),
)
def paged_prefill(
    q: jax.Array,  # [B, S, Hq, D] bf16/f16/f32
    k_pages: jax.Array,  # [N, P, Hk, D] f32/bf16/e4m3 | NVFP4 [N, P, Hk, D//2] u8
    v_pages: jax.Array,  # as k_pages
    block_tables: jax.Array,  # [B, Pt] int32 page ids
    q_pos: jax.Array,  # [B, S] int32 position of each query, -1: padding
    *,
    kv_dtype: KVDtype | str,
    k_scale: jax.Array | None = None,  # FP8 [N, P, Hk] f32 | NVFP4 [N, P, Hk, D//16] e4m3
    v_scale: jax.Array | None = None,
    k_global_scale: jax.Array | None = None,  # NVFP4 [N, P, Hk] f32
    v_global_scale: jax.Array | None = None,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,  # [Hq] sink logits (gpt-oss)
    config: PrefillConfig | None = None,
    out_dtype=None,  # default: q.dtype
    interpret: bool = False,
) -> jax.Array:  # [B, S, Hq, D]
    """Paged-attention prefill of queries at positions ``q_pos`` (semantics: module docstring
    and ``reference.paged_prefill_reference``, which this matches).

    ``config=None`` picks one with ``choose_prefill_config`` from the shapes and the device's
    SM count. ``interpret=True`` runs the Pallas interpreter (CPU tests).

    Contract (not checked: the values are traced): ``q_pos[b, s] < Pt * P`` (keys past the
    table's capacity are cut), and the table entries of the pages a sequence's queries see
    are valid page ids; other entries and page rows are never read.

    Raises ValueError/TypeError naming the argument for malformed inputs and
    NotImplementedError for unsupported combinations (head_dim not in 64/128/256/512, a page
    size that is not a power of two).
    """
    kv_dtype = KVDtype.coerce(kv_dtype)

    # ---- shapes and dtypes ----
    if q.ndim != 4:
        raise ValueError(f"q: expected rank 4 [B, S, Hq, D], got shape {q.shape}")
    b, nq, hq, d = q.shape
    _expect_dtype("q", q, _Q_DTYPES)
    n, p, hk = _check_pages(q, k_pages, v_pages, block_tables, kv_dtype)
    _expect_shape("q_pos", q_pos, (b, nq))
    if not jnp.issubdtype(q_pos.dtype, jnp.integer):
        raise TypeError(f"q_pos: expected an integer dtype, got {q_pos.dtype}")
    if sinks is not None:
        _expect_shape("sinks", sinks, (hq,))
    names = ("k_scale", "v_scale", "k_global_scale", "v_global_scale")
    arrays = dict(zip(names, (k_scale, v_scale, k_global_scale, v_global_scale), strict=True))
    scales = _check_scales(kv_dtype, n, p, hk, d, arrays)
    _check_options(scale, sliding_window, logit_softcap)
    if config is not None and not isinstance(config, PrefillConfig):
        raise TypeError(f"config: expected a PrefillConfig or None, got {type(config).__name__}")
    out_dtype = _out_dtype(q, out_dtype)

    # ---- unsupported combinations ----
    if d not in HEAD_DIMS:
        raise NotImplementedError(f"head_dim {d}: the prefill kernel tiles D in {HEAD_DIMS}")
    if p & (p - 1):
        raise NotImplementedError(
            f"page_size {p}: the prefill kernel needs a power of two (Triton block shapes)"
        )
    if n * p * hk >= 2**31 or b * nq * hq >= 2**31:
        raise NotImplementedError("k_pages / q: rows exceed the kernel's int32 row ids")
    k_pages, v_pages = _page_views(k_pages, v_pages, k_scale, v_scale)

    if b == 0 or nq == 0 or block_tables.shape[1] == 0:  # nothing to read: every row is 0
        return jnp.zeros(q.shape, out_dtype)
    g = hq // hk
    if config is None:
        config = choose_prefill_config(
            b, hk, g, nq, block_tables.shape[1], p, d, kv_dtype, device_sm_count()
        )
    config.check(p, g)

    st = _Static(
        kv_dtype=kv_dtype,
        q_len=nq,
        num_q_heads=hq,
        num_kv_heads=hk,
        group=g,
        heads=config.heads(g),
        head_dim=d,
        page_size=p,
        max_pages=block_tables.shape[1],
        block_q=config.block_q,
        rows=config.rows(g),
        pages_per_step=config.pages_per_step,
        scale=float(scale),
        sliding_window=sliding_window,
        logit_softcap=None if logit_softcap is None else float(logit_softcap),
    )
    return _paged_prefill_pallas(
        q_pos.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        q,
        k_pages,
        scales["k_scale"],
        scales["k_global_scale"],
        v_pages,
        scales["v_scale"],
        scales["v_global_scale"],
        None if sinks is None else sinks.astype(jnp.float32),
        st=st,
        config=config,
        out_dtype=out_dtype,
        interpret=interpret,
    )
