"""MoE decode: the routed experts of a few tokens, expert-major, Pallas kernels on the Triton
lowering.

A decode step (T = 1..64 tokens, k experts each) is bound by the bytes of the distinct selected
experts' weights. Every such expert is read once, by programs that each own (one selected
expert, one tile of output columns) and process ALL (token, slot) pairs routed to that expert.

Plan (``make_plan``, on device, no host sync). The ``P = T * k`` pairs are sorted by expert id
(stable; zero experts -- ids outside ``[0, E)``, LongCat -- sort last and are skipped). Each
run of equal ids is one expert's rows. ``work [3, U]`` lists, for ``U = min(E, P)`` expert slots,
the expert id, its first sorted row and its row count; slots past the number of distinct
experts have 0 rows (their programs exit at once). ``token_of_row [P]`` maps a sorted row to its
token, ``row_of_pair [T, k]`` a pair to its sorted row. The decode entries build it with
Pallas launches, which can also cut the slots into the Mosaic GPU kernels' work items
(``item_rows``): up to ``PALLAS_PLAN_MAX_PAIRS`` pairs one program of pairwise comparisons of
the pair ids (no sort; the entries written by scatter stores; XLA's form of the same algebra
takes six or seven small fusions), up to ``RADIX_PLAN_MAX_PAIRS`` one program that radix-sorts
the pair keys and reads the runs off them (O(P * key bits) work: cumsums, scatter stores, block
barriers). Without Pallas, and past that bound: the pairwise algebra in XLA up to
``DENSE_PLAN_MAX_PAIRS``, then a sort, a cumsum and scatters in XLA.

Kernel 1 (gate_up), grid ``(U, cdiv(I, block_n))``: the program of slot u gathers its rows of
``x`` through ``token_of_row`` (``block_m`` = 16 at a time: one chunk for up to 16 pairs, the
usual case), walks K with the expert's gate and up weight tiles (a free reshape of ``[E, 2I, H]``
to ``[E, 2, I, H]`` concatenated or ``[E, I, 2, H]`` interleaved), adds the biases and writes
``h = act(gate) * up`` rows ``[P, I]`` (bf16, or f32 for f32 inputs) in sorted order.
Kernel 2 (down), grid ``(U, cdiv(H, block_n))``: the same over ``h``'s contiguous rows, writing
``y [P, H]`` f32. The combine (``combine``) gathers each pair's row, puts ``x`` in for zero
experts and sums the k slots weighted, in f32 jnp: no atomics, deterministic.

Tiles are transposed (``swap_ab``): ``dot(w [bn, bk], a^T [bk, bm])``, so the weight tile is the
MMA's large operand and the 16 padded rows its small one. Weights are dequantized per K step in
registers with the grouped matmul's helpers: FP8 block scales multiply each step's f32 partial
(``block_k`` divides the scale block), NVFP4 / MXFP4 scales multiply the E2M1 values; the NVFP4
global scale (per row segment) multiplies the accumulator once. FP4 tiles are not interleaved:
the low nibbles (even k) and high nibbles (odd k) are two ``[bn, bk/2]`` operands, dotted with
the even and odd columns of the activations (16-bit activations: one load of a
uint32 view ``[rows, K/2]``, split into its halves). With
``DecodeTile.f16_dot`` (FP8_BLOCK, NVFP4, MXFP4) the dot operands are f16: e4m3 -> f16 is exact
and one conversion per two values on sm_90, FP4 codes become ``e2m1 * 2^-14`` by bit placement
(in PTX on the GPU, two values per 32-bit op; NVFP4's 2^14 goes into the global scale). MXFP4's
E8M0 scales span more than f16's range, so each K step's partial is scaled like FP8's: by the
column's largest scale in the step (times 2^14), the other scale blocks of the step multiply
their values by ``2^(s - largest)`` in f16 (exact while the step's scales lie within 2^9 of each
other; beyond, the small blocks' products round to f16's 2^-24 step: an absolute error, a
small fraction of the column's pre-activation scale, that a clamped activation (gpt-oss, at
7) can lift to percents of h when the pre-activations are far past the clamp, as in
``tests``' 2^-27 .. 2^8 spread with 1e3-scaled rows; ``f16_dot=False`` has no such loss); each
activation
row is scaled by a power of two into ``[2^10, 2^11)`` and the accumulator scaled back once, so
bf16 activations pass exactly. The row's amax over K comes in with the activations: x's from a
small XLA reduction before the launches, h's from the gate_up kernel, which also writes the
amax of each h row over its column tile (``[P, I tiles]`` f32; the down kernel takes their
max). A gate_up split over K (``DecodeTile.split_k``) writes f32 gate and up partials
instead; one small XLA fusion sums and activates them into h, with its row amax.

W8A8 (``gate_up_act_quant`` / ``down_act_quant`` "fp8", FP8_BLOCK weights): x and h are
quantized to e4m3 per row per 128 of K before their launch (``quantize_activations_fp8``, two
small XLA fusions each) and the dots take the e4m3 weight and activation tiles as they are
loaded: no conversion, so the weight tile reaches the MMA as bytes. Each K step's f32 partial
is multiplied by the weight block scale (per column) and the activation scale (per row).

An extra stack (``ExtraExperts``: a model's shared expert, same format and per-expert shapes)
is read by the same two launches: the caller gives each token one more pair with expert id
``E`` (ids ``E .. E + E2 - 1`` name the extra stack), the plan gives it a slot like any routed
expert, and its programs run the kernel body on the extra stack's refs (``pl.when`` on the
slot's expert id). So the shared expert's weights are read by as many programs as a routed
expert's, in the same waves, instead of by a launch of its own that cannot fill the GPU.

The file reads top-down: the plan, the kernel body on refs, the
``pallas_call`` wrapper, the combine, the jitted public entries.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._dequant import F16_FP4_FACTOR as _F16_FP4_FACTOR
from pallas_kernels._dequant import e2m1_to_f32 as _e2m1_to_f32
from pallas_kernels._dequant import e8m0_step_to_f16 as _e8m0_step_to_f16
from pallas_kernels._dequant import e8m0_to_f32 as _e8m0_to_f32
from pallas_kernels._dequant import fp4x4_to_f16_scaled as _fp4x4_to_f16_scaled
from pallas_kernels._device import device_kind, device_sm_count
from pallas_kernels._offsets import (
    bytes_of_pairs,
    check_offsets,
    pair_view,
    pair_view_if_overflowing,
)
from pallas_kernels.grouped_matmul.config import (
    FP8_ACT_GROUP,
    MXFP4_GROUP,
    NVFP4_GROUP,
    Activation,
    ActivationQuant,
    GateUpLayout,
    WeightFormat,
)
from pallas_kernels.grouped_matmul.kernel import _gated, _repeat_cols
from pallas_kernels.grouped_matmul.reference import (
    GPT_OSS_ALPHA,
    GPT_OSS_LIMIT,
    quantize_activations_fp8,
)
from pallas_kernels.moe_decode.config import (
    FP4_FORMATS,
    DecodeTile,
    MoEDecodeConfig,
    choose_decode_config,
)
from pallas_kernels.paged_attention.decode import (
    _grid,
    _pow2_row_scales,
    _zero_like,
)

_X_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)

# ---------------------------------------------------------------------------------------------
# The plan: pairs sorted by expert, one work entry per distinct expert (on device).
# ---------------------------------------------------------------------------------------------


class DecodePlan(NamedTuple):
    work: jax.Array  # [3, U] int32: expert id (E: idle slot), first sorted row, row count
    token_of_row: jax.Array  # [P] int32 token of each sorted row
    row_of_pair: jax.Array  # [T, k] int32 sorted row of each (token, slot) pair
    routed: jax.Array  # [T, k] bool: the pair goes to a real expert (False: zero expert)
    # [3, W] int32 work items (make_plan's item_rows, from the Pallas plan launch): each slot
    # cut into items of at most item_rows rows (``cut_base``; expert, first sorted row, row
    # count); items past the last: (E, routed rows, 0). None: not cut (``mosaic.work_items``
    # cuts in XLA)
    items: jax.Array | None = None


# Up to this many pairs the plan is built from pairwise comparisons (three small reductions, no
# sort, scan or scatter: fewer XLA launches for the few-token steps); above it, by a sort.
DENSE_PLAN_MAX_PAIRS = 1024
# Up to this many pairs the pairwise plan runs as one Pallas program (``pallas=True``): one
# launch in place of XLA's six or seven small fusions (~7 us of a 1-token step on the H200).
# Its [n, n] comparisons grow with the pairs squared: 1.26 us at 32 pairs, 3.2 at 40, 3.7 at
# 64, 15.2 at 128, against the radix plan's 1.76 / 2.49 / 2.4 / 2.6 (H200, session 13,
# ``benchmarks/moe_decode_plan.py``); a 16-program version (each program the entries of 32
# pairs, the counts over all 512) took 74 us at 512 pairs (session 12).
PALLAS_PLAN_MAX_PAIRS = 32
# Past it (``pallas=True``), up to this many pairs: one Pallas program that radix-sorts the
# pair keys (``_pallas_radix_plan``), in place of XLA's pairwise plan (~10 fusions) and item cut.
RADIX_PLAN_MAX_PAIRS = 1024


def make_plan(expert_ids: jax.Array, num_experts: int, *, pallas: bool = False,
              interpret: bool = False, item_rows: int | None = None,
              blocked: bool = False) -> DecodePlan:
    """Work list of ``expert_ids [T, k]``; ``U = min(E, P)`` slots (a static bound on the
    distinct experts). ``P = T*k <= DENSE_PLAN_MAX_PAIRS``: ``_dense_plan``, else
    ``_sorted_plan``; all give the same plan (slots in increasing expert id, idle slots last,
    rows in the stable sort order). ``pallas``: Pallas launches build it (``interpret``: in
    interpret mode), up to ``PALLAS_PLAN_MAX_PAIRS`` one program of pairwise comparisons, up
    to ``RADIX_PLAN_MAX_PAIRS`` one radix-sort program; with ``item_rows`` those also cut the
    slots into work items (the plan's ``items``; the XLA plans leave it None). ``blocked``:
    each slot's rows moved to blocks of 8 of their own, items one a block (``blocked_plan``;
    with ``pallas``, the radix program at any ``P``)."""
    t, k = expert_ids.shape
    if blocked and pallas and t * k <= RADIX_PLAN_MAX_PAIRS:
        return _pallas_radix_plan(expert_ids, num_experts, interpret=interpret, item_rows=8,
                                  blocked=True)
    if blocked:
        return blocked_plan(make_plan(expert_ids, num_experts), num_experts)
    if pallas and t * k <= PALLAS_PLAN_MAX_PAIRS:
        return _pallas_plan(expert_ids, num_experts, interpret=interpret, item_rows=item_rows)
    if pallas and t * k <= RADIX_PLAN_MAX_PAIRS:
        return _pallas_radix_plan(expert_ids, num_experts, interpret=interpret,
                                 item_rows=item_rows)
    if t * k <= DENSE_PLAN_MAX_PAIRS:
        return _dense_plan(expert_ids, num_experts)
    return _sorted_plan(expert_ids, num_experts)


def _plan_keys(ids, num_experts):
    """Elementwise on int32 pair ids: (sort keys, zero experts -> ``num_experts`` so they sort
    last; routed mask)."""
    routed = (ids >= 0) & (ids < num_experts)
    return jnp.where(routed, ids, num_experts), routed


def _count(mask, axis=None):
    return jnp.sum(mask.astype(jnp.int32), axis=axis)


def _pairwise_plan(key, routed, *, k: int, num_experts: int, slots: int):
    """The plan from ``[n, n]`` / ``[slots, n]`` comparisons of the pair keys ``key [n]``
    (zero experts: ``num_experts``), in ops that XLA and Pallas' Triton lowering both take
    (elementwise, broadcasts, sums along an axis). A pair's sorted row is the number of pairs
    with a smaller key plus those with the same key before it (stable). Keys past the real
    pairs (Pallas' padding, ``num_experts`` and not routed) sort after them and leave their
    rows unchanged. Returns (row_of_pair [n], token_of_row [n], expert, first, rows [slots])."""
    n = key.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    kq, kp = key[None, :], key[:, None]  # [1, n] other pair q, [n, 1] this pair
    same = kq == kp  # [n, n]
    before = _count(same & (idx[None, :] < idx[:, None]), axis=1)
    row_of_pair = _count(kq < kp, axis=1) + before  # [n]
    count = _count(same, axis=1)  # [n] pairs of this pair's expert
    lead = routed & (before == 0)  # [n] the first pair of each distinct real expert
    # level 2: a lead pair's slot (distinct real experts below it); each sorted row's token
    slot = _count(lead[None, :] & (kq < kp), axis=1)  # [n]
    token = jax.lax.div(idx, jnp.int32(k))
    token_of_row = jnp.sum(jnp.where(row_of_pair[None, :] == idx[:, None], token[None, :], 0),
                           axis=1)  # [n]
    num_routed = _count(routed)
    # level 3: slot u's lead pair (at most one) gives the expert, first row and row count
    hit = lead[None, :] & (slot[None, :] == jnp.arange(slots, dtype=jnp.int32)[:, None])
    busy = _count(hit, axis=1) > 0  # [slots]

    def pick(v, idle):
        return jnp.where(busy, jnp.sum(jnp.where(hit, v[None, :], 0), axis=1), idle)

    return (row_of_pair, token_of_row, pick(key, num_experts), pick(row_of_pair, num_routed),
            pick(count, 0))


def _dense_plan(expert_ids: jax.Array, num_experts: int) -> DecodePlan:
    """``_pairwise_plan`` in XLA: three dependent reductions (XLA fuses each, with its
    elementwise producers, into small kernels) instead of a sort, a cumsum, two scatters and a
    gather (each its own launch on the GPU)."""
    t, k = expert_ids.shape
    key, routed = _plan_keys(expert_ids.reshape(-1).astype(jnp.int32), num_experts)
    row_of_pair, token_of_row, expert, first, rows = _pairwise_plan(
        key, routed, k=k, num_experts=num_experts, slots=min(num_experts, t * k))
    return DecodePlan(
        work=jnp.stack([expert, first, rows]),
        token_of_row=token_of_row,
        row_of_pair=row_of_pair.reshape(t, k),
        routed=routed.reshape(t, k),
    )


def _entries(ref, at, values, mask):
    """Scatter ``values[i]`` to ``ref[i, at]`` where ``mask``. Masked-off lanes point past the
    end: in interpret mode a masked store writes the old value back, which must not land on
    another lane's entry."""
    at = jnp.where(mask, at, jnp.int32(ref.shape[1]))
    for i, v in enumerate(values):
        plgpu.store(ref.at[jnp.int32(i), at], v, mask=mask)


def _idle(ref, used, num_experts, num_routed):
    """A ``[3, W]`` ref's entries from ``used`` on: ``(num_experts, routed rows, 0)``."""
    at = jnp.arange(max(16, pl.next_power_of_2(ref.shape[1])), dtype=jnp.int32)
    _entries(ref, at, (jnp.full(at.shape, num_experts, jnp.int32),
                       jnp.broadcast_to(num_routed, at.shape), jnp.zeros_like(at)),
             (at >= used) & (at < ref.shape[1]))


def _pair_rows(ids_ref, p: int, num_experts: int):
    """The ``p`` pair ids (padded to a power of two, >= 16) -> (idx, valid, key, routed, less,
    same, before, row): ``less``/``same`` the ``[n, n]`` key comparisons, ``row`` each pair's
    stable sorted row (``before``: same-key pairs ahead of it)."""
    n = max(16, pl.next_power_of_2(p))
    idx = jnp.arange(n, dtype=jnp.int32)
    valid = idx < p
    # padding: id num_experts, a zero expert's key (sorts after the real pairs, not routed)
    key, routed = _plan_keys(plgpu.load(ids_ref.at[idx], mask=valid, other=num_experts),
                             jnp.int32(num_experts))
    less = key[None, :] < key[:, None]  # [n, n]: pair q (column) sorts below pair p (row)
    same = key[None, :] == key[:, None]
    before = _count(same & (idx[None, :] < idx[:, None]), axis=1)
    row = _count(less, axis=1) + before  # stable sorted row
    return idx, valid, key, routed, less, same, before, row


def _plan_kernel(ids_ref, work_ref, token_of_row_ref, row_of_pair_ref, *items_ref, p: int,
                 k: int, num_experts: int, item_rows: int | None):
    """One program: ``_pairwise_plan``'s comparisons on the ``p`` pair ids (padded to a power
    of two), its entries written by scatter stores: each pair its sorted row and that row's
    token, each expert's first pair the expert's work entry (and, ``item_rows``, its work
    items); then the idle slots (items)."""
    idx, valid, key, routed, less, same, before, row = _pair_rows(ids_ref, p, num_experts)
    num_experts = jnp.int32(num_experts)
    count = _count(same, axis=1)  # pairs of this pair's expert
    lead = routed & (before == 0)  # the first pair of each distinct real expert
    lead_less = less & lead[None, :]
    slot = _count(lead_less, axis=1)  # distinct real experts below this pair's
    num_routed = _count(routed)
    plgpu.store(row_of_pair_ref.at[idx], row, mask=valid)
    plgpu.store(token_of_row_ref.at[jnp.where(valid, row, p)], jax.lax.div(idx, jnp.int32(k)),
                mask=valid)
    _entries(work_ref, slot, (key, row, count), lead)
    _idle(work_ref, _count(lead), num_experts, num_routed)
    if item_rows is None:
        return
    (items_ref,) = items_ref
    chunks = item_count(row, count, item_rows)  # items of each lead pair's expert (cut_base)
    first_item = jnp.sum(jnp.where(lead_less, chunks[None, :], 0), axis=1)
    for c in range(num_items(1, p, item_rows)):  # the c-th item of each expert
        start, end = item_span(row, count, c, item_rows)
        _entries(items_ref, first_item + c, (key, start, end - start), lead & (c < chunks))
    _idle(items_ref, jnp.sum(jnp.where(lead, chunks, 0)), num_experts, num_routed)


def cut_base(first, item_rows: int):
    """Where the items of ``item_rows`` rows of a slot (its sorted rows ``[first, first +
    count)``) are cut: at ``first`` and at every row ``i`` with ``(i - base) % item_rows ==
    0``, ``base = first`` (items of ``item_rows`` rows from the slot's first row) or, for
    ``item_rows`` a multiple of 8, ``first`` rounded down to 8: aligned items, each inside
    the ``item_rows`` rows from its first row rounded down to 8 (``mosaic.window``: an
    activation window of 8 rows, not 16, for items of up to 8). Int scalars or arrays."""
    return first - first % 8 if item_rows % 8 == 0 else first


def item_count(first, count, item_rows: int):
    """The items ``cut_base`` cuts a slot of ``count >= 0`` rows from ``first`` into."""
    base = cut_base(first, item_rows)
    return jnp.where(count > 0, (first + count - 1 - base) // item_rows + 1, 0)


def item_span(first, count, c, item_rows: int):
    """``(start, end)``: the sorted rows of item ``c`` (``< item_count``) of a slot of
    ``count`` rows from ``first``, cut by ``cut_base``."""
    base = cut_base(first, item_rows)
    return (jnp.maximum(first, base + c * item_rows),
            jnp.minimum(first + count, base + (c + 1) * item_rows))


def num_items(slots: int, pairs: int, item_rows: int) -> int:
    """A static bound on the work items: a slot of ``c`` rows has at most ``cdiv(c,
    item_rows)`` items, aligned ones (``cut_base``, ``r = item_rows``) at most ``1 + (c + 6)
    // r``, and ``(c + 6) // r <= c / (r - 6)``; so all ``U`` slots at most ``U + cdiv(P,
    r)``, aligned ``U + min((P + 6 U) // r, P // (r - 6))``; and at most ``P`` (an item has
    a row)."""
    if item_rows % 8 == 0:
        extra = min((pairs + 6 * slots) // item_rows, pairs // (item_rows - 6))
    else:
        extra = pl.cdiv(pairs, item_rows)
    return min(slots + extra, pairs)


def num_blocks(slots: int, pairs: int) -> int:
    """A static bound on a blocked plan's blocks of 8 (``blocked_plan``): a slot of c rows
    takes ``cdiv(c, 8) <= 1 + (c - 1) // 8`` blocks, so ``U`` slots at most ``U + cdiv(P,
    8)``; and at most ``P`` (a block has a row)."""
    return min(slots + pl.cdiv(pairs, 8), pairs)


def blocked_plan(plan: DecodePlan, num_experts: int) -> DecodePlan:
    """``plan`` with each slot's rows moved to blocks of 8 of their own: slot u's rows start at
    row ``8 * B_u`` (``B_u``: the blocks of 8 the slots before it need), its j-th 8 rows are
    block ``B_u + j``; rows no pair takes are padding (token -1). Returns the plan with the
    moved ``row_of_pair``, ``token_of_row [8 W]`` and ``work`` first rows, and ``items [3,
    W]`` one a block (expert, first row, up to 8 rows; past the last: ``(num_experts, routed
    rows, 0)``), ``W = num_blocks(U, P)``. So an expert of up to 8 rows is one item of 8
    rows read in a window of 8 (``mosaic``) at any token count. XLA ops on the plan's ``[U]``
    / ``[P]`` arrays (the radix plan program makes the same in one launch)."""
    expert, first, count = plan.work  # [U]; busy slots first, in increasing first row
    u = expert.shape[0]
    t, k = plan.row_of_pair.shape
    p = t * k
    w = num_blocks(u, p)
    blocks = (count + 7) // 8  # [U]
    ends = jnp.cumsum(blocks)  # [U] inclusive
    start = ends - blocks  # [U] each slot's first block
    rows = plan.row_of_pair.reshape(-1)
    routed = plan.routed.reshape(-1)
    busy = count > 0
    slot = jnp.sum((first[None, :] <= rows[:, None]) & busy[None, :], axis=1) - 1  # [P]
    slot = jnp.clip(slot, 0, u - 1)
    off = rows - first[slot]
    moved = jnp.where(routed, 8 * start[slot] + off, 0)  # off // 8 blocks on, off % 8 in it
    token = jnp.arange(p, dtype=jnp.int32) // k
    token_of_row = jnp.full((8 * w,), -1, jnp.int32).at[jnp.where(routed, moved, 8 * w)].set(
        token, mode="drop")
    b = jnp.arange(w, dtype=jnp.int32)
    bslot = jnp.sum((ends[None, :] <= b[:, None]).astype(jnp.int32), axis=1)  # [W]
    used = bslot < u
    bs = jnp.minimum(bslot, u - 1)
    n = jnp.where(used, jnp.minimum(8, count[bs] - 8 * (b - start[bs])), 0)
    items = jnp.stack([jnp.where(used, expert[bs], num_experts),
                       jnp.where(used, 8 * b, jnp.sum(count)), n]).astype(jnp.int32)
    first = jnp.where(busy, 8 * start, jnp.sum(count))  # idle slots: the routed rows
    return plan._replace(work=jnp.stack([expert, first, count]).astype(jnp.int32),
                         token_of_row=token_of_row, row_of_pair=moved.reshape(t, k),
                         items=items)


def _plan_call(kernel, expert_ids: jax.Array, num_experts: int, *, name: str, num_warps: int,
               interpret: bool, item_rows: int | None, inputs: tuple = (),
               outputs: tuple = (), grid: tuple[int, ...] = (), blocked: bool = False):
    """Pallas ``kernel(ids_ref, *inputs' refs, work_ref, token_of_row_ref, row_of_pair_ref,
    [items_ref], *outputs' refs, p=, k=, num_experts=, item_rows=)`` over the flat pair ids
    (one program; ``grid`` for more): the plan, or ``(plan, outputs)`` given ``outputs``
    (ShapeDtypeStructs of more results)."""
    t, k = expert_ids.shape
    p = t * k
    slots = min(num_experts, p)
    flat = expert_ids.reshape(p).astype(jnp.int32)
    out_shape = [jax.ShapeDtypeStruct((3, slots), jnp.int32),
                 jax.ShapeDtypeStruct((8 * num_blocks(slots, p) if blocked else p,), jnp.int32),
                 jax.ShapeDtypeStruct((p,), jnp.int32)]
    if item_rows is not None:
        items = num_blocks(slots, p) if blocked else num_items(slots, p, item_rows)
        out_shape.append(jax.ShapeDtypeStruct((3, items), jnp.int32))
    work, token_of_row, row_of_pair, *rest = pl.pallas_call(
        functools.partial(kernel, p=p, k=k, num_experts=num_experts, item_rows=item_rows),
        out_shape=out_shape + list(outputs),
        grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=name,
    )(flat, *inputs)
    items = rest.pop(0) if item_rows is not None else None  # rest: then the outputs
    plan = DecodePlan(work=work, token_of_row=token_of_row, row_of_pair=row_of_pair.reshape(t, k),
                      routed=_plan_keys(flat, num_experts)[1].reshape(t, k), items=items)
    return (plan, tuple(rest)) if outputs else plan


def _pallas_plan(expert_ids: jax.Array, num_experts: int, *, interpret: bool,
                 item_rows: int | None = None) -> DecodePlan:
    """``_dense_plan``'s plan from one Pallas launch (P <= PALLAS_PLAN_MAX_PAIRS), with the
    work items of ``item_rows`` rows when asked."""
    return _plan_call(_plan_kernel, expert_ids, num_experts, name="moe_decode_plan",
                      num_warps=4, interpret=interpret, item_rows=item_rows)


def _radix_plan_kernel(ids_ref, work_ref, token_of_row_ref, row_of_pair_ref, *items_ref,
                       p: int, k: int, num_experts: int, item_rows: int | None, barrier: bool,
                       blocked: bool = False):
    """One program, O(P * bits) work: the ``p`` pair keys ``key << shift | pair`` sorted by a
    stable LSD radix sort over the key's bits, two a pass (a lane's new row is the lanes of
    smaller digits plus those of its digit before it -- cumsums of 16-bit counters packed two
    to an int32 -- scattered into one of two global buffers, ``token_of_row_ref`` and
    ``row_of_pair_ref``, in turn, read back after a block barrier). Lane r then holds sorted
    row r: a run of equal keys is one expert's rows; its first lane writes the slot's expert
    and first row (slot: a cumsum of the run starts), its last lane reads the first row back
    (after a barrier) and writes the row count; with ``item_rows``, every row at a multiple of
    ``item_rows`` within its run writes the work item it starts (its run's first item: a
    cumsum of the runs' item counts). ``blocked`` (``item_rows`` 8): the rows move to blocks
    of 8 (``blocked_plan``): row r of a run from ``first`` goes to ``8 * item + (r - first) %
    8``, its item counted from the run's first row, and ``token_of_row`` (``[8 W]``) is -1 on
    the rows no pair takes. No [p, p] comparisons. ``barrier`` False in interpret mode (no
    lowering there; the interpreter runs the stores and loads in program order)."""
    n = max(16, pl.next_power_of_2(p))
    shift = max(1, (p - 1).bit_length())
    r = jnp.arange(n, dtype=jnp.int32)
    valid = r < p
    num_experts_ = jnp.int32(num_experts)
    past = jnp.int32((num_experts + 1) << shift)  # a key past every real one (lanes >= p)

    def sync():
        if barrier:
            plgpu.debug_barrier()

    key, _ = _plan_keys(plgpu.load(ids_ref.at[r], mask=valid, other=num_experts_), num_experts_)
    comp = jnp.where(valid, jax.lax.shift_left(key, jnp.int32(shift)) | r, past)
    buffers = (token_of_row_ref, row_of_pair_ref)
    passes = pl.cdiv(num_experts.bit_length(), 2)  # keys 0..num_experts (zero experts)
    for i in range(passes):  # 2-bit digits d: lanes before this one with digit d by cumsums
        d = jax.lax.shift_right_logical(comp, jnp.int32(shift + 2 * i)) & 3
        lo = jnp.where(valid & (d < 2), jax.lax.shift_left(1, 16 * d), 0)  # d 0, 1: 16 bits each
        hi = jnp.where(valid & (d == 2), 1, 0)
        c_lo, c_hi = jax.lax.cumsum(lo, axis=0) - lo, jax.lax.cumsum(hi, axis=0) - hi
        t_lo, t_hi = jnp.sum(lo), jnp.sum(hi)
        b0, b1 = c_lo & 0xFFFF, jax.lax.shift_right_logical(c_lo, 16)
        t0, t1 = t_lo & 0xFFFF, jax.lax.shift_right_logical(t_lo, 16)
        before = jnp.where(d == 0, b0, jnp.where(d == 1, b1, jnp.where(d == 2, c_hi,
                                                                          r - b0 - b1 - c_hi)))
        base = jnp.where(d == 0, 0, jnp.where(d == 1, t0, jnp.where(d == 2, t0 + t1,
                                                                     t0 + t1 + t_hi)))
        buf = buffers[i % 2]
        plgpu.store(buf.at[jnp.where(valid, base + before, p)], comp, mask=valid)
        sync()
        comp = plgpu.load(buf.at[r], mask=valid, other=past)
    sorted_ref = buffers[(passes - 1) % 2]

    def key_at(i, mask, other):
        return jax.lax.shift_right_arithmetic(
            plgpu.load(sorted_ref.at[jnp.clip(i, 0, p - 1)], mask=mask, other=other),
            jnp.int32(shift))

    key = jax.lax.shift_right_arithmetic(comp, jnp.int32(shift))
    pair = comp & jnp.int32((1 << shift) - 1)
    routed = key < num_experts_
    starts = routed & (key != key_at(r - 1, valid & (r > 0), jnp.int32(-1)))
    ends = routed & (key != key_at(r + 1, r + 1 < p, past))
    slot = jax.lax.cumsum(starts.astype(jnp.int32), axis=0) - 1
    num_routed = _count(routed)
    sync()  # every lane has read the sorted buffer: it may now be overwritten
    plgpu.store(row_of_pair_ref.at[jnp.where(valid, pair, p)], r, mask=valid)
    plgpu.store(token_of_row_ref.at[r], jax.lax.div(pair, jnp.int32(k)), mask=valid)
    _entries(work_ref, slot, (key, r), starts)

    def slot_entry(i, mask):  # work_ref[i, slot] of each lane's run (written before a sync)
        return plgpu.load(work_ref.at[jnp.int32(i), jnp.where(mask, slot, 0)], mask=mask,
                          other=0)

    sync()
    count = r + 1 - slot_entry(1, ends)  # at the last lane of each run
    plgpu.store(work_ref.at[jnp.int32(2), jnp.where(ends, slot, work_ref.shape[1])], count,
                mask=ends)
    _idle(work_ref, _count(starts), num_experts_, num_routed)
    if item_rows is None:
        return
    (items_ref,) = items_ref
    rows = jnp.int32(item_rows)
    sync()
    first, count = slot_entry(1, routed), slot_entry(2, routed)  # every row: its run's
    if blocked:
        chunks = jnp.where(ends, (count + 7) // 8, 0)  # a run's blocks
        off = r - first
        moved = 8 * (jax.lax.cumsum(chunks, axis=0) - chunks + off // 8) + off % 8
        sync()  # every lane has read its run's first row: it may now move
        plgpu.store(work_ref.at[jnp.int32(1), jnp.where(starts, slot, work_ref.shape[1])],
                    moved, mask=starts)
        plgpu.store(row_of_pair_ref.at[jnp.where(valid, pair, p)], jnp.where(routed, moved, 0),
                    mask=valid)
        size = token_of_row_ref.shape[0]
        for c in range(pl.cdiv(size, n)):  # padding rows: -1
            at = c * n + r
            plgpu.store(token_of_row_ref.at[jnp.where(at < size, at, size)],
                        jnp.full((n,), -1, jnp.int32), mask=at < size)
        sync()
        plgpu.store(token_of_row_ref.at[jnp.where(routed, moved, size)],
                    jax.lax.div(pair, jnp.int32(k)), mask=routed)
        _entries(items_ref, moved // 8, (key, moved, jnp.minimum(count - off, 8)),
                 routed & (off % 8 == 0))
        _idle(items_ref, jnp.sum(chunks), num_experts_, num_routed)
        return
    chunks = jnp.where(ends, item_count(first, count, item_rows), 0)  # a run's items
    off = r - cut_base(first, item_rows)  # row from its run's cut base
    item = jax.lax.cumsum(chunks, axis=0) - chunks + jax.lax.div(off, rows)
    end = jnp.minimum(first + count, r - jax.lax.rem(off, rows) + rows)  # its item's end
    _entries(items_ref, item, (key, r, end - r),
             routed & ((jax.lax.rem(off, rows) == 0) | (r == first)))
    _idle(items_ref, jnp.sum(chunks), num_experts_, num_routed)


def _pallas_radix_plan(expert_ids: jax.Array, num_experts: int, *, interpret: bool,
                       item_rows: int | None = None, blocked: bool = False) -> DecodePlan:
    """The plan from one Pallas program that radix-sorts the pair keys
    (``_radix_plan_kernel``): the same plan (and work items) as ``_dense_plan`` (its cut), for
    any ``P`` up to ``RADIX_PLAN_MAX_PAIRS``."""
    if expert_ids.size >= 1 << 16:  # the sort's digit counters are 16-bit fields
        raise ValueError(f"radix plan: {expert_ids.size} pairs, at most {(1 << 16) - 1}")
    return _plan_call(functools.partial(_radix_plan_kernel, barrier=not interpret,
                                        blocked=blocked), expert_ids,
                      num_experts, name="moe_decode_radix_plan",
                      num_warps=4 if expert_ids.size <= 512 else 8, interpret=interpret,
                      item_rows=item_rows, blocked=blocked)


def _sorted_plan(expert_ids: jax.Array, num_experts: int) -> DecodePlan:
    """The plan from one sort of the ``P`` pair ids, a cumsum and two scatters."""
    t, k = expert_ids.shape
    p = t * k
    u = min(num_experts, p)
    key, routed = _plan_keys(expert_ids.reshape(-1).astype(jnp.int32), num_experts)
    row = jnp.arange(p, dtype=jnp.int32)
    sorted_key, order = jax.lax.sort((key, row), num_keys=1, is_stable=True)  # [P], [P]
    prev = jnp.concatenate([jnp.full((1,), -1, jnp.int32), sorted_key[:-1]])
    starts = (sorted_key != prev) & (sorted_key < num_experts)  # [P] first row of an expert
    slot = jnp.cumsum(starts, dtype=jnp.int32) - 1  # [P] slot of each routed row
    num_routed = jnp.sum(routed, dtype=jnp.int32)
    # first[u] for u < #distinct, then num_routed (idle slots, and the sentinel u = U).
    first = jnp.full((u + 1,), num_routed, jnp.int32).at[jnp.where(starts, slot, u + 1)].set(
        row, mode="drop")
    rows = first[1:] - first[:-1]  # [U]; 0 for idle slots
    first = first[:u]
    expert = jnp.where(rows > 0, sorted_key[jnp.minimum(first, p - 1)], num_experts)
    row_of_pair = jnp.zeros((p,), jnp.int32).at[order].set(row, unique_indices=True)
    return DecodePlan(
        work=jnp.stack([expert, first, rows]).astype(jnp.int32),
        token_of_row=order // k,
        row_of_pair=row_of_pair.reshape(t, k),
        routed=routed.reshape(t, k),
    )


# ---------------------------------------------------------------------------------------------
# Kernel body.
# ---------------------------------------------------------------------------------------------


def _epilogue(gate, up, activation: Activation, limit: float | None, alpha: float):
    """``act(gate) * up`` in f32 (SiLU with a limit clamps first: DeepSeek-V4)."""
    if activation is Activation.SILU and limit is not None:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return _gated(gate, up, activation, alpha, limit if limit is not None else 0.0)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernel body specializes on (hashable)."""

    fmt: WeightFormat
    halves: int  # 2: gate_up (gate and up accumulators, gated epilogue); 1: down
    layout: GateUpLayout  # INTERLEAVED: w [E, N, 2, Kw]; else [E, halves, N, Kw]
    activation: Activation | None  # gate_up epilogue (None: down, or gate_up split over K)
    limit: float | None  # SILU: clamp (None: none); GPT_OSS: its limit
    alpha: float
    gather_rows: bool  # rows of a_ref are tokens (via row_map_ref), else the sorted rows
    split_k: int  # K ranges, one program each (grid axis 2); partials out [S, P, G, N] f32
    n: int  # output columns per half
    k: int  # contraction length (unpacked)
    block_m: int
    block_n: int
    block_k: int
    swap_ab: bool
    f16_dot: bool
    fp8_block: tuple[int, int]
    global_rows: int  # NVFP4: rows of w (over all halves) sharing one global scale
    compute_dtype: jnp.dtype  # dot operand dtype
    inline_asm: bool  # GPU: NVFP4 f16 unpack in PTX (interpret mode: the same in jnp)
    w_pairs: bool  # w_ref is the uint16 view of 1-byte weights (pallas_kernels._offsets)
    main_experts: int | None = None  # an extra stack (the shared expert) follows expert ids
    #   [0, main_experts) of the main one (None: no extra stack)
    write_amax: bool = False  # gate_up before an f16-dot down: also write each h row's amax
    #   over this program's columns ([P, column tiles] f32), the down kernel's row scales
    a_pairs: bool = False  # FP4: a_ref is the uint32 view [rows, K/2] of 16-bit activations
    #   (k = 2j low half, 2j + 1 high half): the even / odd K columns of a step in one
    #   contiguous load, instead of two stride-2 gathers that Triton reads element by element

    @property
    def a8(self) -> bool:
        """W8A8: a_ref is e4m3, amax_ref its f32 scales [rows, cdiv(K, 128)], and the dots are
        e4m3 x e4m3 (FP8_BLOCK weights, no conversion)."""
        return self.compute_dtype == jnp.float8_e4m3fn


def expert_matmul_kernel(
    work_ref,  # [3, U] int32: expert id (E: idle), first sorted row, row count
    row_map_ref,  # [P] int32 token of each sorted row (gate_up) | None (down)
    a_ref,
    amax_ref,
    *refs,  # the main stack's (w, scale, global, bias), [the extra stack's], o, [amax out]
    st: _Static,
):
    """One (expert slot, column tile, K range) program. With an extra stack (``st.main_experts``
    set: the shared expert folded into the routed launch) expert ids from ``main_experts`` on
    name the extra stack's experts, and the program runs the body on that stack's refs."""
    u, n_tile, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    e = work_ref[0, u]
    common = (u, n_tile, split, work_ref, row_map_ref, a_ref, amax_ref)
    if st.main_experts is None:
        _expert_body(e, *common, *refs, st=st)
        return
    main, extra, outs = refs[:4], refs[4:8], refs[8:]

    @pl.when(e < st.main_experts)
    def _():
        _expert_body(e, *common, *main, *outs, st=st)

    @pl.when(e >= st.main_experts)  # idle slots too (E total): their row count is 0
    def _():
        _expert_body(e - st.main_experts, *common, *extra, *outs, st=st)


def _expert_body(
    e,  # this program's expert, an index into w_ref's stack
    u,  # expert slot
    n_tile,  # column tile
    split,  # this program's K range: steps [kb_lo, kb_hi)
    work_ref,  # [3, U] int32: expert id (E: idle), first sorted row, row count
    row_map_ref,  # [P] int32 token of each sorted row (gate_up) | None (down)
    a_ref,  # [T, K] x (gate_up) | [P, K] h (down)
    amax_ref,  # f16 dots: [T, 1] x's row amax | [P, C] h's, per gate_up column tile (max over
    #   C; C = 1 after a split gate_up) | W8A8: the rows' scales [rows, cdiv(K, 128)] f32 |
    #   None (bf16/f32 dots)
    w_ref,  # [E, halves, N, Kw] | [E, N, 2, Kw] (interleaved); Kw = K, or K/2 u8 (FP4)
    scale_ref,  # FP8: [E, cdiv(halves*N, b0), cdiv(K, b1)] f32 | FP4: as w_ref, K/16 or K/32
    global_ref,  # [E, R] f32 (NVFP4) | None
    bias_ref,  # as w_ref without the K axis | None
    o_ref,  # [S, P, G, N]: h (bf16/f32; G = 1) | gate, up partials (f32; G = 2) | y (f32)
    *amax_out_ref,  # st.write_amax: [P, cdiv(N, block_n)] f32, the amax of each h row's tile
    st: _Static,
):
    bm, bn, bk = st.block_m, st.block_n, st.block_k
    n0 = n_tile * bn
    num_steps = pl.cdiv(st.k, bk)
    per_split = pl.cdiv(num_steps, st.split_k)
    kb_lo = split * per_split
    kb_hi = jnp.minimum(kb_lo + per_split, num_steps)
    first = work_ref[1, u]
    num_rows = work_ref[2, u]  # 0 for an idle slot: no chunk runs

    cols = n0 + jnp.arange(bn, dtype=jnp.int32)  # [bn]
    n_ragged = st.n % bn != 0
    k_ragged = st.k % bk != 0
    col_mask = cols < st.n
    fp4 = st.fmt in FP4_FORMATS
    interleaved = st.layout is GateUpLayout.INTERLEAVED
    precision = jax.lax.Precision.HIGHEST if st.compute_dtype == jnp.float32 else None
    div = jax.lax.div  # non-negative integer division without jnp's sign fix-ups

    # K columns of one step: FP4 splits them into even (low nibble) and odd (high nibble) ones.
    kk = jnp.arange(bk // 2 if fp4 else bk, dtype=jnp.int32)
    col_sets = (2 * kk, 2 * kk + 1) if fp4 else (kk,)

    def w_at(ref, h, *minor):
        """Indexer of ``ref`` at this expert, half ``h``, output columns ``cols`` (+ minor)."""
        h = jnp.int32(h)  # a Python int index trips the interpret-mode load discharge
        if not minor:  # bias: [bn]
            return ref.at[(e, cols, h) if interleaved else (e, h, cols)]
        c = cols[:, None]
        return ref.at[(e, c, h, *minor) if interleaved else (e, h, c, *minor)]

    def orig_rows(h):
        """Row of the unreshaped ``w [E, halves*N, K]`` behind each output column of half h."""
        return 2 * cols + h if interleaved else h * st.n + cols

    def masked_load(ref_at, *masks):
        masks = [m for m in masks if m is not None]
        if not masks:
            return plgpu.load(ref_at)
        return plgpu.load(ref_at, mask=functools.reduce(jnp.logical_and, masks),
                          other=_zero_like(ref_at.dtype))

    n_mask = col_mask[:, None] if n_ragged else None

    def load_w_cols(h, c0, step, row_len):
        """``[bn, step]`` of half h's weight columns ``[c0, c0 + step)`` (masked past N and
        ``row_len``). With ``st.w_pairs`` w_ref holds byte pairs as uint16 (low byte first):
        read ``step / 2`` pairs and split them into the uint8 bytes."""
        if st.w_pairs:
            c0, step, row_len = c0 // 2, step // 2, row_len // 2
        cc = c0 + jnp.arange(step, dtype=jnp.int32)
        c_mask = (cc < row_len)[None, :] if k_ragged else None
        w = masked_load(w_at(w_ref, h, cc[None, :]), n_mask, c_mask)
        return bytes_of_pairs(w) if st.w_pairs else w

    def load_w(h, kb):
        """One K step of half h: (dot operands [bn, bk] (FP4: even, odd [bn, bk/2]),
        f32 per-column scale [bn] or None)."""
        match st.fmt:
            case WeightFormat.BF16 | WeightFormat.FP8_BLOCK:
                w = load_w_cols(h, kb * bk, bk, st.k)  # [bn, bk]
                if st.w_pairs:  # bytes -> e4m3
                    w = jax.lax.bitcast_convert_type(w, jnp.float8_e4m3fn)
                # W8A8: compute_dtype is e4m3 (no conversion)
                dot_dtype = jnp.float16 if st.f16_dot else st.compute_dtype
                if st.fmt is WeightFormat.BF16:
                    return (w.astype(dot_dtype),), None
                b0, b1 = st.fp8_block
                s_at = scale_ref.at[e, div(orig_rows(h), b0), div(kb * bk, b1)]
                s = masked_load(s_at, col_mask if n_ragged else None)  # [bn] f32
                # e4m3 -> f16 / bf16: exact. The guarded PTX conversion (_dequant.fp8_to_f16)
                # cut the offline SASS 331 -> 281 instructions but measured 7-12% slower on the
                # H200 (Qwen3, 1-64 tokens), as it did in the paged decode kernel.
                return (w.astype(dot_dtype),), s
            case WeightFormat.NVFP4 | WeightFormat.MXFP4:
                group = NVFP4_GROUP if st.fmt is WeightFormat.NVFP4 else MXFP4_GROUP
                kp, ks = bk // 2, bk // group  # packed bytes, scales per K step
                sc = kb * ks + jnp.arange(ks, dtype=jnp.int32)
                s_mask = (sc < st.k // group)[None, :] if k_ragged else None
                codes = load_w_cols(h, kb * kp, kp, st.k // 2)  # [bn, bk/2] uint8
                raw_s = masked_load(w_at(scale_ref, h, sc[None, :]), n_mask, s_mask)
                if st.f16_dot:
                    lo, hi = _fp4x4_to_f16_scaled(codes, st.inline_asm)
                    if st.fmt is WeightFormat.NVFP4:  # e2m1 * 2^-14 * f16(e4m3 scale), exact
                        s = _repeat_cols(raw_s.astype(jnp.float16), group // 2)  # [bn, bk/2]
                        return (lo * s, hi * s), None
                    # MXFP4: e2m1 * 2^-14 * 2^(s - top), top = the column's largest scale in
                    # this step; 2^(top - 127) * 2^14 multiplies the step's f32 partial.
                    e8 = raw_s.astype(jnp.int32)  # [bn, bk/32]
                    top = jnp.max(e8, axis=1)  # [bn]
                    s = _repeat_cols(_e8m0_step_to_f16(e8 - top[:, None]), group // 2)
                    return (lo * s, hi * s), _e8m0_to_f32(top) * _F16_FP4_FACTOR
                codes = codes.astype(jnp.int32)
                if st.fmt is WeightFormat.NVFP4:
                    s = raw_s.astype(jnp.float32)
                else:
                    s = _e8m0_to_f32(raw_s.astype(jnp.int32))
                s = _repeat_cols(s, group // 2)  # [bn, bk/2]: scale of byte j is s[j*2//group]
                lo = _e2m1_to_f32(codes & 0xF) * s  # even k
                hi = _e2m1_to_f32(codes >> 4) * s  # odd k
                return (lo.astype(st.compute_dtype), hi.astype(st.compute_dtype)), None

    def a_tile(src, row_mask, kb, cs):
        """[bm, len(cs)] activations of the rows ``src`` at K columns ``kb * bk + cs``."""
        kc = kb * bk + cs
        mask = row_mask[:, None] & (kc < st.k)[None, :] if k_ragged else row_mask[:, None]
        return plgpu.load(a_ref.at[_grid(src, kc)], mask=mask, other=0.0)

    def a_tiles(src, row_mask, kb):
        """The activation tiles of one K step, one per column set (``col_sets``)."""
        if not st.a_pairs:
            return [a_tile(src, row_mask, kb, cs) for cs in col_sets]
        kc = kb * (bk // 2) + kk  # pairs of K columns (2j, 2j + 1)
        mask = row_mask[:, None] & (kc < st.k // 2)[None, :] if k_ragged else row_mask[:, None]
        pairs = plgpu.load(a_ref.at[_grid(src, kc)], mask=mask, other=0)  # [bm, bk/2] u32
        return [jax.lax.bitcast_convert_type(half.astype(jnp.uint16), st.compute_dtype)
                for half in (pairs & 0xFFFF, pairs >> 16)]

    def row_scales(src, row_mask):
        """f16 dots: powers of two ``(up, down)`` [bm] with ``amax * up`` in [2^10, 2^11) over
        each row's whole K, so that the K loop only multiplies and the accumulator is scaled
        back once. The amax comes with the activations (``amax_ref``: one load; a pre-pass
        over the rows here, a serial walk over K, had cost ~10% of an FP8 / NVFP4 step on
        the H200)."""
        c = jnp.arange(pl.next_power_of_2(amax_ref.shape[1]), dtype=jnp.int32)
        pieces = plgpu.load(amax_ref.at[_grid(src, c)],
                            mask=row_mask[:, None] & (c < amax_ref.shape[1])[None, :],
                            other=0.0)  # [bm, C]
        return _pow2_row_scales(jnp.max(pieces, axis=1))

    def load_a(src, row_mask, kb, up):
        """One K step of the rows ``src`` [bm]: dot operands per column set [bm, bk(/2)]."""
        tiles = a_tiles(src, row_mask, kb)
        if up is None:
            return tuple(t.astype(st.compute_dtype) for t in tiles)
        return tuple((t.astype(jnp.float32) * up[:, None]).astype(jnp.float16) for t in tiles)

    def dot(w, a):  # [bn, bkc] x [bm, bkc] -> [bn, bm] (swap_ab) | [bm, bn]
        lhs, rhs = (w, a) if st.swap_ab else (a, w)
        return jax.lax.dot_general(lhs, rhs, (((1,), (1,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)

    def per_col(v):  # [bn] factor of the output columns, broadcast against a partial
        return v[:, None] if st.swap_ab else v[None, :]

    def per_row(v):  # [bm] factor of the rows, broadcast against a partial
        return v[None, :] if st.swap_ab else v[:, None]

    def a8_scales(src, row_mask, kb):
        """W8A8: [bm] f32 scales of the rows' activation group holding K step ``kb``."""
        group = jnp.full((bm,), div(kb * bk, FP8_ACT_GROUP), jnp.int32)
        return plgpu.load(amax_ref.at[src, group], mask=row_mask, other=0.0)

    def compute(src, row_mask):
        """[bm, bn] f32 output rows of this chunk (epilogue applied)."""
        up, down = row_scales(src, row_mask) if st.f16_dot else (None, None)

        def body(kb, accs):
            a_tiles = load_a(src, row_mask, kb, up)
            a_s = a8_scales(src, row_mask, kb) if st.a8 else None
            new = []
            for h, acc in enumerate(accs):
                w_tiles, w_s = load_w(h, kb)
                dots = [dot(w, a) for w, a in zip(w_tiles, a_tiles, strict=True)]
                if a_s is not None:  # W8A8: both block scales multiply the step's partial
                    new.append(acc + dots[0] * per_col(w_s) * per_row(a_s))
                elif w_s is not None:
                    new.append(acc + functools.reduce(jnp.add, dots) * per_col(w_s))
                else:  # acc + dot, one at a time: each add folds into the MMA's accumulator
                    new.append(functools.reduce(jnp.add, dots, acc))
            return tuple(new)

        zeros = jnp.zeros((bn, bm) if st.swap_ab else (bm, bn), jnp.float32)
        accs = jax.lax.fori_loop(kb_lo, kb_hi, body, (zeros,) * st.halves)

        outs = []
        for h, acc in enumerate(accs):
            if st.swap_ab:
                acc = acc.T  # [bm, bn]
            if down is not None:
                acc = acc * down[:, None]  # undo the rows' power-of-two scaling
            if global_ref is not None:
                gs = masked_load(global_ref.at[e, div(orig_rows(h), st.global_rows)],
                                 col_mask if n_ragged else None)  # [bn] f32
                if st.f16_dot:
                    gs = gs * _F16_FP4_FACTOR
                acc = acc * gs[None, :]
            if bias_ref is not None:
                b = masked_load(w_at(bias_ref, h), col_mask if n_ragged else None)
                b = b.astype(jnp.float32)
                if st.split_k > 1:
                    b = jnp.where(split == 0, b, 0.0)  # once, in the first K range
                acc = acc + b[None, :]
            outs.append(acc)
        if st.activation is None:
            return outs  # down: [y]; split gate_up: [gate, up] partials
        return [_epilogue(*outs, st.activation, st.limit, st.alpha)]

    def chunk(c, carry):
        j = c * bm + jnp.arange(bm, dtype=jnp.int32)  # [bm] row within the expert
        row_mask = j < num_rows
        rows = first + j  # [bm] sorted rows
        src = rows
        if st.gather_rows:
            src = plgpu.load(row_map_ref.at[rows], mask=row_mask, other=0)  # [bm] tokens
        mask = row_mask[:, None] & col_mask[None, :] if n_ragged else row_mask[:, None]
        for g, out in enumerate(compute(src, row_mask)):
            out = out.astype(o_ref.dtype)
            plgpu.store(o_ref.at[split, rows[:, None], jnp.int32(g), cols[None, :]], out,
                        mask=mask)
            if st.write_amax:  # of h as stored, as the down kernel reads it
                mag = jnp.abs(out.astype(jnp.float32))
                if n_ragged:
                    mag = jnp.where(col_mask[None, :], mag, 0.0)
                tile = jnp.full((1, 1), n_tile, jnp.int32)
                plgpu.store(amax_out_ref[0].at[rows[:, None], tile],
                            jnp.max(mag, axis=1)[:, None], mask=row_mask[:, None])
        return carry

    jax.lax.fori_loop(0, div(num_rows + bm - 1, bm), chunk, jnp.int32(0))


# ---------------------------------------------------------------------------------------------
# pallas_call wrapper.
# ---------------------------------------------------------------------------------------------


def _expert_matmul_pallas(
    work,  # [3, U] int32
    row_map,  # [P] int32 | None
    a,  # [T, K] | [P, K]
    a_amax,  # [T, 1] | [P, C] f32 | None
    w,  # [E, halves, N, Kw] | [E, N, 2, Kw]
    scale,  # format-specific (see expert_matmul_kernel) | None
    global_scale,  # [E, R] f32 | None
    bias,  # [E, halves, N] | [E, N, 2] | None
    extra,  # the extra stack's (w, scale, global_scale, bias), as the main one's | None
    *,
    st: _Static,
    tile: DecodeTile,
    num_rows: int,
    out_dtype,
    interpret: bool,
    name: str,
) -> jax.Array:
    # No BlockSpecs: every operand is passed whole (a pointer in Triton); the program finds its
    # expert and rows in the work list, so its blocks start at data-dependent places.
    # (expert slots, column tiles, K ranges)
    grid = (work.shape[1], pl.cdiv(st.n, tile.block_n), st.split_k)
    planes = 2 if st.halves == 2 and st.activation is None else 1  # split gate_up: gate, up
    out_shape = [jax.ShapeDtypeStruct((st.split_k, num_rows, planes, st.n), out_dtype)]
    if st.write_amax:
        out_shape.append(jax.ShapeDtypeStruct((num_rows, grid[1]), jnp.float32))
    return pl.pallas_call(
        functools.partial(expert_matmul_kernel, st=st),
        grid=grid,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tile.num_warps,
                                             num_stages=tile.num_stages),
        interpret=interpret,
        name=(f"moe_decode_{name}_{st.fmt.value}{'_f16' if st.f16_dot else ''}"
              f"{'_w8a8' if st.a8 else ''}"
              f"_bm{tile.block_m}_bn{tile.block_n}_bk{tile.block_k}_s{st.split_k}"
              f"{'_x' if extra else ''}"),
    )(work, row_map, a, a_amax, w, scale, global_scale, bias, *(extra or ()))


# ---------------------------------------------------------------------------------------------
# The two launches and the combine.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Weights:
    """A validated expert weight stack and its format arrays."""

    w: jax.Array  # [E, N, Kw]
    scale: jax.Array | None
    global_scale: jax.Array | None  # [E, R] f32 (NVFP4)
    bias: jax.Array | None  # [E, N]
    global_rows: int


def _expect(name, arr, shape=None, dtypes=None):
    if shape is not None and tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(arr.shape)}")
    if dtypes is not None and arr.dtype not in [jnp.dtype(d) for d in dtypes]:
        allowed = ", ".join(str(jnp.dtype(d)) for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({allowed}), got {arr.dtype}")


def _check_weights(name, w, scale, global_scale, bias, *, fmt, num_experts, n, k, block_size
                   ) -> _Weights:
    """Validates one stack ``[E, n, k]`` (logical) of format ``fmt``; raises naming ``name``."""
    e = num_experts
    if w.ndim != 3:
        raise ValueError(f"{name}: expected rank 3 [E, N, K(/2)], got shape {w.shape}")
    match fmt:
        case WeightFormat.BF16:
            _expect(name, w, (e, n, k), (jnp.bfloat16, jnp.float16, jnp.float32))
            if scale is not None:
                raise ValueError(f"{name}_scale: BF16 weights take no scale")
        case WeightFormat.FP8_BLOCK:
            _expect(name, w, (e, n, k), (jnp.float8_e4m3fn,))
            if scale is None:
                raise ValueError(f"{name}_scale: FP8_BLOCK needs scale_inv [E, cdiv(N,b0), "
                                 "cdiv(K,b1)]")
            b0, b1 = block_size
            _expect(f"{name}_scale", scale, (e, pl.cdiv(n, b0), pl.cdiv(k, b1)))
            scale = scale.astype(jnp.float32)
        case WeightFormat.NVFP4 | WeightFormat.MXFP4:
            group = NVFP4_GROUP if fmt is WeightFormat.NVFP4 else MXFP4_GROUP
            if k % group:
                raise ValueError(f"{name}: {fmt.value} needs K to be a multiple of {group}, "
                                 f"got K={k}")
            _expect(name, w, (e, n, k // 2), (jnp.uint8,))
            if scale is None:
                raise ValueError(f"{name}_scale: {fmt.value} needs scale [E, N, K/{group}]")
            s_dtype = jnp.float8_e4m3fn if fmt is WeightFormat.NVFP4 else jnp.uint8
            _expect(f"{name}_scale", scale, (e, n, k // group), (s_dtype,))
    global_rows = n
    if fmt is WeightFormat.NVFP4:
        if global_scale is None:
            global_scale = jnp.ones((e, 1), jnp.float32)
        global_scale = global_scale.astype(jnp.float32).reshape(e, -1)  # [E, R]
        if n % global_scale.shape[1]:
            raise ValueError(f"{name}_global_scale: R={global_scale.shape[1]} row segments must "
                             f"divide N={n}")
        global_rows = n // global_scale.shape[1]
    elif global_scale is not None:
        raise ValueError(f"{name}_global_scale: only NVFP4 has a global scale, fmt is "
                         f"{fmt.value}")
    if bias is not None:
        _expect(f"{name}_bias", bias, (e, n))
    return _Weights(w, scale, global_scale, bias, global_rows)


def _split_halves(a, halves: int, layout: GateUpLayout):
    """Free reshape ``[E, halves*N, ...]`` -> ``[E, halves, N, ...]`` | ``[E, N, 2, ...]``."""
    if a is None:
        return None
    e, rows = a.shape[:2]
    if layout is GateUpLayout.INTERLEAVED and halves == 2:
        return a.reshape(e, rows // 2, 2, *a.shape[2:])
    return a.reshape(e, halves, rows // halves, *a.shape[2:])


def _launch(a, a_amax, plan, wts: _Weights, extra: _Weights | None, *, fmt, halves, layout,
            activation, limit, alpha, block_size, tile: DecodeTile, num_rows, out_dtype,
            write_amax, interpret, name):
    """One launch: ``[[split_k, num_rows, planes, N]]`` (planes 2: split gate_up partials),
    and with ``write_amax`` the h rows' amax per column tile ``[num_rows, N tiles]``. Expert
    ids from ``wts``' E on name ``extra``'s experts (same format and per-expert shapes)."""
    n = wts.w.shape[1] // halves
    k = a.shape[-1]
    layout = layout if halves == 2 else GateUpLayout.CONCATENATED
    w, w_pairs = pair_view_if_overflowing("w", _split_halves(wts.w, halves, layout))

    def operands(stack: _Weights, w):
        scale = stack.scale if fmt is WeightFormat.FP8_BLOCK else _split_halves(
            stack.scale, halves, layout)
        return w, scale, stack.global_scale, _split_halves(stack.bias, halves, layout)

    main = operands(wts, w)
    extra_ops = None
    if extra is not None:
        w2 = _split_halves(extra.w, halves, layout)
        extra_ops = operands(extra, pair_view(w2) if w_pairs else w2)
    st = _Static(
        fmt=fmt, halves=halves, layout=layout,
        activation=activation, limit=limit, alpha=float(alpha),
        gather_rows=name == "gate_up", split_k=tile.split_k, n=n, k=k, block_m=tile.block_m,
        block_n=tile.block_n, block_k=tile.block_k, swap_ab=tile.swap_ab,
        f16_dot=tile.f16_dot, fp8_block=tuple(block_size), global_rows=wts.global_rows,
        compute_dtype=jnp.dtype(a.dtype),  # e4m3 for W8A8
        inline_asm=not interpret, w_pairs=w_pairs, write_amax=write_amax,
        main_experts=None if extra is None else wts.w.shape[0],
        a_pairs=fmt in FP4_FORMATS and jnp.dtype(a.dtype).itemsize == 2)
    if st.a_pairs:
        a = jax.lax.bitcast_convert_type(a.reshape(a.shape[0], k // 2, 2), jnp.uint32)
    for prefix, ops in (("", main), ("extra_", extra_ops or ())):
        check_offsets({f"{prefix}{nm}": v for nm, v in zip(
            ("w", "scale", "global_scale", "bias"), ops, strict=False)})
    check_offsets(dict(a=a))
    return _expert_matmul_pallas(
        plan.work, plan.token_of_row if st.gather_rows else None, a, a_amax, *main, extra_ops,
        st=st, tile=tile, num_rows=num_rows, out_dtype=out_dtype, interpret=interpret,
        name=name)


def combine(y_sorted: jax.Array, plan: DecodePlan, x: jax.Array, weights: jax.Array
            ) -> jax.Array:
    """``sum_j weights[t, j] * (y of pair (t, j), or x[t] for a zero expert)`` in f32.

    ``y_sorted [S, P, H]`` (S split-K partials, rows in sorted order), ``x [T, H]``,
    ``weights [T, k]`` -> ``[T, H]``. A gather and a (S x k)-term sum per token (one XLA
    fusion): no atomics, a fixed order.
    """
    pairs = pairs_of(y_sorted, plan)  # [T, k, H], zero-expert pairs 0
    vals = jnp.where(plan.routed[..., None], pairs, x.astype(jnp.float32)[:, None, :])
    return jnp.sum(weights.astype(jnp.float32)[..., None] * vals, axis=1)


def pairs_of(y_sorted: jax.Array, plan: DecodePlan) -> jax.Array:
    """Rows of ``y_sorted [S, P, H]`` (summed over the S split-K partials) in pair order
    ``[T, k, H]`` f32; zero-expert pairs 0 (their rows were never written)."""
    t, k = plan.row_of_pair.shape
    pairs = jnp.take(y_sorted, plan.row_of_pair.reshape(-1), axis=1,
                     mode="clip")  # [S, P, H]; rows are in range
    pairs = jnp.sum(pairs.astype(jnp.float32), axis=0).reshape(t, k, -1)
    return jnp.where(plan.routed[..., None], pairs, 0.0)


# ---------------------------------------------------------------------------------------------
# Public entries.
# ---------------------------------------------------------------------------------------------

_STATIC = ("fmt", "activation", "gate_up_layout", "limit", "alpha", "block_size", "h_dtype",
           "config", "interpret", "gate_up_act_quant", "down_act_quant")


class ExtraExperts(NamedTuple):
    """A second expert stack that the same two launches read: a model's shared expert folded
    into the routed step (one program per (expert, column tile) either way, so the shared
    expert's weights are read by as many programs as a routed expert's, in the same waves).
    Expert ids ``E .. E + E2 - 1`` name its experts. Same format as the main stack, with the
    same per-expert shapes, FP8 block, NVFP4 row segments and bias presence."""

    gate_up: jax.Array  # [E2, 2I, H] | [E2, 2I, H//2] u8 (FP4)
    down: jax.Array  # [E2, H, I] | [E2, H, I//2] u8 (FP4)
    gate_up_scale: jax.Array | None = None
    gate_up_global_scale: jax.Array | None = None
    gate_up_bias: jax.Array | None = None
    down_scale: jax.Array | None = None
    down_global_scale: jax.Array | None = None
    down_bias: jax.Array | None = None


def _check_extra(extra: ExtraExperts, gu: _Weights, dn: _Weights, *, fmt, hidden, inter,
                 block_size) -> tuple[_Weights, _Weights]:
    """Validates the extra stack against the main one's format arrays (ValueError naming the
    ``extra_`` argument)."""
    if not isinstance(extra, ExtraExperts):
        raise TypeError(f"extra: expected ExtraExperts, got {type(extra).__name__}")
    if extra.gate_up.ndim != 3:
        raise ValueError(f"extra_gate_up: expected rank 3, got shape {extra.gate_up.shape}")
    e2 = extra.gate_up.shape[0]
    out = []
    for name, main, n, k in (("gate_up", gu, 2 * inter, hidden), ("down", dn, hidden, inter)):
        arrs = [getattr(extra, f"{name}{sfx}") for sfx in ("", "_scale", "_global_scale",
                                                             "_bias")]
        wts = _check_weights(f"extra_{name}", *arrs, fmt=fmt, num_experts=e2, n=n, k=k,
                             block_size=block_size)
        if wts.global_rows != main.global_rows:
            raise ValueError(f"extra_{name}_global_scale: {n // wts.global_rows} row segments, "
                             f"the main stack has {n // main.global_rows}")
        if (wts.bias is None) != (main.bias is None):
            raise ValueError(f"extra_{name}_bias: given for one stack only")
        if wts.w.dtype != main.w.dtype:
            raise TypeError(f"extra_{name}: dtype {wts.w.dtype}, the main stack's is "
                            f"{main.w.dtype}")
        out.append(wts)
    return out[0], out[1]


def _experts(x, expert_ids, gate_up, down, *, fmt, gate_up_scale, gate_up_global_scale,
             gate_up_bias, down_scale, down_global_scale, down_bias, activation,
             gate_up_layout, limit, alpha, block_size, h_dtype, config, interpret, extra,
             gate_up_act_quant, down_act_quant):
    """Validates, plans and runs both launches: (y_sorted [S, P, H] f32 partials, plan)."""
    fmt = WeightFormat.coerce(fmt)
    gate_up_act_quant = ActivationQuant.coerce(gate_up_act_quant)
    down_act_quant = ActivationQuant.coerce(down_act_quant)
    for name, aq in (("gate_up_act_quant", gate_up_act_quant),
                     ("down_act_quant", down_act_quant)):
        if aq is ActivationQuant.FP8 and fmt is not WeightFormat.FP8_BLOCK:
            raise NotImplementedError(f"{name}: W8A8 needs FP8_BLOCK weights, got {fmt.value}")
        if aq not in (ActivationQuant.NONE, ActivationQuant.FP8):
            raise NotImplementedError(f"{name}: {aq.value} activations are not supported by the "
                                      "decode kernels (none, fp8)")
    gu_a8 = gate_up_act_quant is ActivationQuant.FP8
    dn_a8 = down_act_quant is ActivationQuant.FP8
    activation = Activation.coerce(activation)
    layout = GateUpLayout.coerce(gate_up_layout)
    if (not isinstance(block_size, tuple) or len(block_size) != 2
            or not all(isinstance(b, int) and b > 0 for b in block_size)):
        raise ValueError(f"block_size: expected a tuple of two positive ints, got {block_size!r}")
    if x.ndim != 2:
        raise ValueError(f"x: expected rank 2 [T, H], got shape {x.shape}")
    if x.dtype not in [jnp.dtype(d) for d in _X_DTYPES]:
        raise NotImplementedError(f"x: dtype {x.dtype} not supported (bf16, f16, f32)")
    if expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids: expected shape ({x.shape[0]}, k), got {expert_ids.shape}")
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise TypeError(f"expert_ids: expected an integer dtype, got {expert_ids.dtype}")
    if activation is Activation.GELU_TANH and limit is not None:
        raise ValueError(f"limit: only the SiLU and gpt-oss activations clamp, got {limit!r} "
                         "with gelu_tanh")
    if activation is Activation.GPT_OSS and limit is None:
        limit = GPT_OSS_LIMIT
    t, hidden = x.shape
    if gate_up.ndim != 3 or down.ndim != 3:
        raise ValueError(f"gate_up, down: expected rank 3, got shapes {gate_up.shape}, "
                         f"{down.shape}")
    e, two_i = gate_up.shape[:2]
    if two_i % 2:
        raise ValueError(f"gate_up: expected an even number of rows 2I, got {two_i}")
    inter = two_i // 2
    gu = _check_weights("gate_up", gate_up, gate_up_scale, gate_up_global_scale, gate_up_bias,
                        fmt=fmt, num_experts=e, n=two_i, k=hidden, block_size=block_size)
    dn = _check_weights("down", down, down_scale, down_global_scale, down_bias, fmt=fmt,
                        num_experts=e, n=hidden, k=inter, block_size=block_size)
    xgu = xdn = None
    if extra is not None:
        xgu, xdn = _check_extra(extra, gu, dn, fmt=fmt, hidden=hidden, inter=inter,
                                block_size=block_size)
    e_all = e + (0 if extra is None else extra.gate_up.shape[0])
    if h_dtype is None:
        h_dtype = jnp.float32 if x.dtype == jnp.float32 else jnp.bfloat16
    h_dtype = jnp.dtype(h_dtype)
    if h_dtype not in [jnp.dtype(d) for d in _X_DTYPES]:
        raise NotImplementedError(f"h_dtype: {h_dtype} not supported (bf16, f16, f32)")
    if config is None:
        config = choose_decode_config(
            t, expert_ids.shape[1], e_all, hidden, inter, fmt, fp8_block=block_size,
            x_itemsize=x.dtype.itemsize, sm_count=device_sm_count(), device_kind=device_kind(),
            gate_up_act_quant=gate_up_act_quant, down_act_quant=down_act_quant)
    if not isinstance(config, MoEDecodeConfig):
        raise ValueError(f"config: expected a MoEDecodeConfig, got {config!r}")
    config.check_format(fmt, fp8_block=block_size, gate_up_act_quant=gate_up_act_quant,
                        down_act_quant=down_act_quant)

    plan = make_plan(expert_ids, e_all, pallas=True, interpret=interpret)
    p = plan.token_of_row.shape[0]
    common = dict(fmt=fmt, layout=layout, limit=limit, alpha=alpha, block_size=block_size,
                  num_rows=p, interpret=interpret)
    split = config.gate_up.split_k > 1  # gate_up partials, summed and activated by XLA
    # f16 dots scale each activation row by a power of two from its amax: x's here (one small
    # XLA reduction), h's from gate_up's epilogue (per column tile), or from the XLA fusion
    # that sums and activates a split gate_up's partials. W8A8 quantizes x / h per row per 128
    # of K before each launch (the grouped matmul's quantize_activations_fp8: two small XLA
    # fusions each). Quantizing each K step's tile in the kernels instead (one group per row
    # and 128-wide step) saved those launches but measured slower (H200, full steps: Qwen3
    # 2 / 3 tokens 55.2 / 61.9 vs 44.4 / 54.9 us, gpt-oss-120b / DeepSeek-V3 1 token 68 / 182
    # vs 59 / 150; Qwen3 1 token 39.9 vs 41.1): the quantization sat in every program's loop.
    x_in, x_aux = x, None
    if gu_a8:
        x_in, x_aux = quantize_activations_fp8(x)  # [T, H] e4m3, [T, cdiv(H, 128)] f32
    elif config.gate_up.f16_dot:
        x_aux = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1, keepdims=True)  # [T, 1]
    h, *h_aux = _launch(
        x_in, x_aux, plan, gu, xgu, halves=2, tile=config.gate_up, name="gate_up",
        out_dtype=jnp.float32 if split else h_dtype, activation=None if split else activation,
        write_amax=config.down.f16_dot and not split,
        **common)  # [S1, P, 2, I] | [1, P, 1, I]
    if split:  # one small fusion; rows of idle slots hold garbage that no program reads
        parts = jnp.sum(h, axis=0)  # [P, 2, I]
        h = _epilogue(parts[:, 0], parts[:, 1], activation, limit, alpha).astype(h_dtype)
        if config.down.f16_dot:
            h_aux = [jnp.max(jnp.abs(h.astype(jnp.float32)), axis=1, keepdims=True)]  # [P, 1]
    else:
        h = h.reshape(p, inter)
    if dn_a8:  # rows of idle slots hold garbage: quantized too, never read
        h, h_scale = quantize_activations_fp8(h)
        h_aux = [h_scale]
    (y,) = _launch(h, h_aux[0] if h_aux else None, plan, dn, xdn, halves=1, tile=config.down,
                   out_dtype=jnp.float32, name="down", activation=None, write_amax=False,
                   **common)
    return y.reshape(config.down.split_k, p, hidden), plan  # [S2, P, H]


@functools.partial(jax.jit, static_argnames=_STATIC)
def moe_decode_pairs(
    x: jax.Array,  # [T, H] bf16/f16/f32
    expert_ids: jax.Array,  # [T, k] int; outside [0, E (+ E2, extra)): zero expert (skipped)
    gate_up: jax.Array,  # [E, 2I, H] | [E, 2I, H//2] u8 (FP4)
    down: jax.Array,  # [E, H, I] | [E, H, I//2] u8 (FP4)
    *,
    fmt: WeightFormat | str,
    gate_up_scale: jax.Array | None = None,  # FP8 scale_inv | NVFP4 e4m3 | MXFP4 u8 (E8M0)
    gate_up_global_scale: jax.Array | None = None,  # NVFP4 [E, R] or [E] f32
    gate_up_bias: jax.Array | None = None,  # [E, 2I]
    down_scale: jax.Array | None = None,
    down_global_scale: jax.Array | None = None,
    down_bias: jax.Array | None = None,  # [E, H]
    activation: Activation | str = Activation.SILU,
    gate_up_layout: GateUpLayout | str = GateUpLayout.CONCATENATED,
    limit: float | None = None,  # SILU: optional clamp; GPT_OSS: its limit (default 7.0)
    alpha: float = GPT_OSS_ALPHA,
    block_size: tuple[int, int] = (128, 128),  # FP8_BLOCK scale block (b0 along N, b1 along K)
    h_dtype=None,  # intermediate h between the launches: bf16 (f32 for f32 x)
    config: MoEDecodeConfig | None = None,
    interpret: bool = False,
    extra: ExtraExperts | None = None,  # a second stack: expert ids E .. E + E2 - 1
    gate_up_act_quant: ActivationQuant | str = ActivationQuant.NONE,  # fp8: W8A8 gate_up
    down_act_quant: ActivationQuant | str = ActivationQuant.NONE,  # fp8: W8A8 down
) -> jax.Array:
    """Routed expert outputs of each (token, slot) pair, ``[T, k, H]`` f32 (zero experts: 0).

    Expert-major Pallas kernels (module docstring): each selected expert's weights are read once
    per step. ``config=None`` picks the tiles with ``choose_decode_config`` from the shapes and
    the default device. ``gate_up_act_quant`` / ``down_act_quant`` "fp8" (FP8_BLOCK weights
    only): W8A8, that kernel's activations quantized per row per 128 of K
    (``quantize_activations_fp8``: x before gate_up, h before down, one small XLA fusion each)
    and e4m3 x e4m3 dots, both block scales on each K step's f32 partial. Raises
    ValueError/TypeError for malformed inputs and NotImplementedError for unsupported dtypes
    or combinations.
    """
    if x.shape[0] == 0:
        return jnp.zeros((0, expert_ids.shape[1], x.shape[1]), jnp.float32)
    y, plan = _experts(
        x, expert_ids, gate_up, down, fmt=fmt, gate_up_scale=gate_up_scale,
        gate_up_global_scale=gate_up_global_scale, gate_up_bias=gate_up_bias,
        down_scale=down_scale, down_global_scale=down_global_scale, down_bias=down_bias,
        activation=activation, gate_up_layout=gate_up_layout, limit=limit, alpha=alpha,
        block_size=block_size, h_dtype=h_dtype, config=config, interpret=interpret,
        extra=extra, gate_up_act_quant=gate_up_act_quant, down_act_quant=down_act_quant)
    return pairs_of(y, plan)


@functools.partial(jax.jit, static_argnames=_STATIC)
def moe_decode(
    x: jax.Array,  # [T, H] bf16/f16/f32
    expert_ids: jax.Array,  # [T, k] int; outside [0, E (+ E2)): zero expert (identity in the
    #   combine)
    weights: jax.Array,  # [T, k] routing weights
    gate_up: jax.Array,  # [E, 2I, H] | [E, 2I, H//2] u8 (FP4)
    down: jax.Array,  # [E, H, I] | [E, H, I//2] u8 (FP4)
    *,
    fmt: WeightFormat | str,
    gate_up_scale: jax.Array | None = None,
    gate_up_global_scale: jax.Array | None = None,
    gate_up_bias: jax.Array | None = None,
    down_scale: jax.Array | None = None,
    down_global_scale: jax.Array | None = None,
    down_bias: jax.Array | None = None,
    activation: Activation | str = Activation.SILU,
    gate_up_layout: GateUpLayout | str = GateUpLayout.CONCATENATED,
    limit: float | None = None,
    alpha: float = GPT_OSS_ALPHA,
    block_size: tuple[int, int] = (128, 128),
    h_dtype=None,
    config: MoEDecodeConfig | None = None,
    interpret: bool = False,
    extra: ExtraExperts | None = None,
    gate_up_act_quant: ActivationQuant | str = ActivationQuant.NONE,
    down_act_quant: ActivationQuant | str = ActivationQuant.NONE,
) -> jax.Array:
    """The routed experts' combined output ``sum_j weights[t, j] * expert_j(x[t])``, ``[T, H]``
    f32; zero experts contribute ``weights[t, j] * x[t]``. Keywords as ``moe_decode_pairs``."""
    if x.shape[0] == 0:
        return jnp.zeros(x.shape, jnp.float32)
    _expect("weights", weights, expert_ids.shape)
    y, plan = _experts(
        x, expert_ids, gate_up, down, fmt=fmt, gate_up_scale=gate_up_scale,
        gate_up_global_scale=gate_up_global_scale, gate_up_bias=gate_up_bias,
        down_scale=down_scale, down_global_scale=down_global_scale, down_bias=down_bias,
        activation=activation, gate_up_layout=gate_up_layout, limit=limit, alpha=alpha,
        block_size=block_size, h_dtype=h_dtype, config=config, interpret=interpret,
        extra=extra, gate_up_act_quant=gate_up_act_quant, down_act_quant=down_act_quant)
    return combine(y, plan, x, weights)
