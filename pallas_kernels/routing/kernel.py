"""Router kernel: router logits -> (top-k expert ids, weights) in one Pallas launch (Triton
lowering), where XLA takes two to three fusions (the top-k by ranks or a sort, the softmax or
the gathered weights, each re-reducing the router matmul's split-K partials).

A program routes ``block_tokens`` tokens: their ``[B, E]`` logits (E padded to a power of
two) in registers, the scores, then the top-k by k rounds of "largest key, lowest column among
equals" (two row reductions a round) on int32 keys in IEEE total order (NaN above +inf, -0
below +0: ``jax.lax.top_k``'s order), so the ids are ``jax.lax.top_k``'s for every input,
NaN included; then the weights. DeepSeek-V3's group-limited selection first ranks the groups
by the sum of their top-2 choices the same way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.routing.config import RouterRule, Scoring, block_tokens

_LOWEST = jnp.iinfo(jnp.int32).min
# One warp a program: the k rounds' row reductions stay warp shuffles (no shared memory, no
# block barriers). Four warps over 8 tokens x 128 experts took 6.8 us on the H200.
NUM_WARPS = 1


def _order_key(v):
    """f32 -> int32 keys ordered as the floats in IEEE total order."""
    bits = jax.lax.bitcast_convert_type(v, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _select(key, valid, cols, k: int):
    """The ``k`` largest ``key [B, N]`` among ``valid``, ties to the lower column: k rounds of
    (picked column ``[B]``, its key ``[B]``, its ``[B, N]`` hit mask), best first."""
    n = jnp.int32(key.shape[1])
    taken = cols < 0  # all False, [B, N]
    rounds = []
    for _ in range(k):
        avail = valid & ~taken
        best = jnp.max(jnp.where(avail, key, _LOWEST), axis=1)  # [B]
        col = jnp.min(jnp.where(avail & (key == best[:, None]), cols, n), axis=1)  # [B]
        hit = cols == col[:, None]
        taken = taken | hit
        rounds.append((col, best, hit))
    return rounds


def _key_value(key):
    """The f32 value of an ``_order_key`` (the map is its own inverse)."""
    return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ 0x7FFFFFFF, key), jnp.float32)


def _pick(values, hit):
    """Each row's value at its one ``hit`` column, bit for bit (an integer sum)."""
    bits = jax.lax.bitcast_convert_type(values, jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.sum(jnp.where(hit, bits, 0), axis=1), jnp.float32)


def _scores(logits, valid, scoring: Scoring):
    match scoring:
        case Scoring.SOFTMAX:
            m = jnp.max(jnp.where(valid, logits, -jnp.inf), axis=1)
            p = jnp.where(valid, jnp.exp(logits - m[:, None]), 0.0)
            return p / jnp.sum(p, axis=1)[:, None]
        case Scoring.SIGMOID:
            return 1.0 / (1.0 + jnp.exp(-logits))
        case Scoring.SQRT_SOFTPLUS:  # softplus as log(1 + e^x), stable for large |x|
            return jnp.sqrt(jnp.maximum(logits, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(logits))))
        case Scoring.TOPK_SOFTMAX:
            return logits


def _group_mask(choice, valid, cols, rule: RouterRule, e: int):
    """``[B, N]``: the columns inside each token's ``topk_group`` groups with the largest sum
    of their top-2 choices."""
    per_group, g = e // rule.n_group, rule.n_group
    group = cols // per_group  # [B, N]
    key = _order_key(choice)
    gcols = jax.lax.broadcasted_iota(jnp.int32, (choice.shape[0], pl.next_power_of_2(g)), 1)
    gscore = jnp.zeros(gcols.shape, jnp.float32)
    for i in range(g):
        (_, k1, _), (_, k2, _) = _select(key, valid & (group == i), cols, 2)
        top2 = _key_value(k1) + _key_value(k2)  # [B]
        gscore = jnp.where(gcols == i, top2[:, None], gscore)
    kept = cols < 0
    for pick, _, _ in _select(_order_key(gscore), gcols < g, gcols, rule.topk_group):
        kept = kept | (group == pick[:, None])
    return kept


def _router_kernel(logits_ref, *refs, t: int, e: int, rule: RouterRule, block: int,
                   bias: bool, expert_scale: bool):
    # logits_ref: [T * E] f32; bias_ref: [E] f32; scale_ref: [E] f32;
    # ids_ref: [T * k] int32; weights_ref: [T * k] f32
    refs = list(refs)
    bias_ref = refs.pop(0) if bias else None
    scale_ref = refs.pop(0) if expert_scale else None
    ids_ref, weights_ref = refs
    k = rule.k
    n, kp = pl.next_power_of_2(e), pl.next_power_of_2(k)
    rows = pl.program_id(0) * block + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (block, n), 1)
    valid = (cols < e) & (rows < t)  # [B, N]
    logits = plgpu.load(logits_ref.at[jnp.where(valid, rows * e + cols, 0)], mask=valid,
                        other=0.0)
    s = _scores(logits, valid, rule.scoring)
    choice, on_scores = s, bias_ref is None and rule.n_group == 1  # selecting on s itself
    if bias_ref is not None:
        choice = s + plgpu.load(bias_ref.at[jnp.where(valid, cols, 0)], mask=valid, other=0.0)
    if rule.n_group > 1:
        choice = jnp.where(_group_mask(choice, valid, cols, rule, e), choice, 0.0)
    rounds = _select(_order_key(choice), valid, cols, k)
    kcols = jax.lax.broadcasted_iota(jnp.int32, (block, kp), 1)
    ids = jnp.zeros((block, kp), jnp.int32)
    w = jnp.zeros((block, kp), jnp.float32)
    for j, (pick, best, hit) in enumerate(rounds):
        # the chosen score: the picked key's value where the choice is the score itself
        score = _key_value(best) if on_scores else _pick(s, hit)
        ids = jnp.where(kcols == j, pick[:, None], ids)
        w = jnp.where(kcols == j, score[:, None], w)
    chosen = kcols < k
    if rule.scoring is Scoring.TOPK_SOFTMAX:  # softmax over the chosen logits
        m = jnp.max(jnp.where(chosen, w, -jnp.inf), axis=1)
        p = jnp.where(chosen, jnp.exp(w - m[:, None]), 0.0)
        w = p / jnp.sum(p, axis=1)[:, None]
    elif rule.normalize:
        w = w / (jnp.sum(jnp.where(chosen, w, 0.0), axis=1)[:, None] + rule.norm_eps)
    w = w * rule.scale
    if scale_ref is not None:
        at = jnp.minimum(ids, scale_ref.shape[0] - 1)
        w = w * plgpu.load(scale_ref.at[at], mask=chosen, other=1.0)
    out = chosen & (rows < t)
    at = jnp.where(out, rows * k + kcols, t * k)  # masked lanes past the end (interpret mode)
    plgpu.store(ids_ref.at[at], ids, mask=out)
    plgpu.store(weights_ref.at[at], w, mask=out)


@functools.partial(jax.jit, static_argnames=("rule", "interpret"))
def route(logits: jax.Array, rule: RouterRule, selection_bias: jax.Array | None = None,
          expert_scale: jax.Array | None = None, *, interpret: bool = False
          ) -> tuple[jax.Array, jax.Array]:
    """``logits [T, E]`` (float; taken as f32) -> (ids ``[T, k]`` int32, weights ``[T, k]``
    f32) under ``rule``; ``selection_bias [E]`` is added to the scores for the selection only,
    ``expert_scale [E]`` multiplies each chosen expert's weight. One launch of
    ``cdiv(T, block_tokens)`` programs."""
    if logits.ndim != 2 or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"logits: expected float [T, E], got {logits.dtype} {logits.shape}")
    t, e = logits.shape
    rule.check(e)
    for name, v in (("selection_bias", selection_bias), ("expert_scale", expert_scale)):
        if v is not None and v.shape != (e,):
            raise ValueError(f"{name}: expected shape ({e},), got {v.shape}")
    if t == 0:
        return jnp.zeros((0, rule.k), jnp.int32), jnp.zeros((0, rule.k), jnp.float32)
    block = block_tokens(t, e)
    extra = tuple(v.astype(jnp.float32) for v in (selection_bias, expert_scale) if v is not None)
    ids, w = pl.pallas_call(
        functools.partial(_router_kernel, t=t, e=e, rule=rule, block=block,
                          bias=selection_bias is not None, expert_scale=expert_scale is not None),
        out_shape=[jax.ShapeDtypeStruct((t * rule.k,), jnp.int32),
                   jax.ShapeDtypeStruct((t * rule.k,), jnp.float32)],
        grid=(pl.cdiv(t, block),),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="moe_router",
    )(logits.astype(jnp.float32).reshape(-1), *extra)
    return ids.reshape(t, rule.k), w.reshape(t, rule.k)
