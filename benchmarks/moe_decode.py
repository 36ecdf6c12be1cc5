"""MoE decode-step benchmark: full jitted ``moe_forward`` decode steps (routing + experts +
combine) with the Pallas expert-major decode kernels against the ``jax.lax.ragged_dot`` path
(``grouped_matmul="xla", moe_path="prefill"``) and the XLA gather+einsum decode path
(``grouped_matmul="xla", moe_path="decode"``), with the HBM copy bandwidth measured in the same
run.

    python benchmarks/moe_decode.py [--quick] [--shapes ...] [--formats ...] [--tokens ...]
                                    [--peer-formats ...] [--sweep] [--out results.md]
    python benchmarks/moe_decode.py --tiny      # CPU smoke test: tiny shapes, interpret mode

Columns: ``experts`` distinct selected experts (from the routing of the timed inputs), ``MB``
their weight bytes (data, scales, biases: the minimum a step must read), ``us`` per step,
``GB/s`` = MB / us, ``frac_hbm`` = GB/s over the measured copy bandwidth, ``vs_ragged_dot`` and
``vs_xla_decode`` the speed-ups over the two XLA paths. ``us`` is device time per step: the steps
run inside one jitted ``lax.scan`` (``_common.time_scan``: the marginal time of a step, a
call's own dispatch and wait taken out), as a decode loop runs them (CUDA graphs or a scan over
layers); ``host_us`` is one jitted call per step from Python, which adds
the host's dispatch of the weight pytree (~30 us) where the step is shorter than that. Each
step routes a different set of tokens (``ROTATE`` input sets in turn), so consecutive steps
select different experts and the selected weights do not stay in L2 between steps. A shared
expert (DeepSeek-V3) is in every step; ``--no-shared`` skips its own section.

Step 1 checks the kernels on the GPU (kernel vs plain-jnp reference, bf16 and f16 dots, every
format; moe_forward pallas vs XLA decode); step 2 times; ``--sweep`` also times a few tile
variants of the kernels alone (routing precomputed) against the heuristic's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import atlas_jax as aj  # noqa: E402
from atlas_jax.config import Format, MoEConfig  # noqa: E402
from atlas_jax.moe.params import MoEParams  # noqa: E402
from atlas_jax.quant import QTensor, quantize  # noqa: E402
from benchmarks._common import (  # noqa: E402
    device_busy,
    hbm_copy_bandwidth,
    rotating,
    table,
    time_jax,
    time_scan,
)
from pallas_kernels._device import device_kind, device_sm_count  # noqa: E402
from pallas_kernels.moe_decode import (  # noqa: E402
    MoEDecodeConfig,
    choose_decode_config,
    moe_decode,
    moe_decode_reference,
)

SHAPES = {  # name: (H, I, E, k, router / activation of the model)
    "qwen3-30b-a3b": (2048, 768, 128, 8, dict()),
    "deepseek-v3": (7168, 2048, 256, 8, dict(
        scoring="sigmoid", selection_bias=True, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_eps=1e-20, shared_intermediate_size=2048)),
    "gpt-oss-120b": (2880, 2880, 128, 4, dict(
        scoring="topk_softmax", router_bias=True, activation="gpt_oss", swiglu_limit=7.0,
        gate_up_layout="interleaved", expert_bias=True)),
}
# A one-expert layer every token selects: DeepSeek-V3's shared expert as the decode kernels run
# it (moe.experts.shared_experts), for --sweep
SWEEP_ONLY = {"deepseek-v3-shared": (7168, 2048, 1, 1, dict())}
# Other models' routed experts, by name only (not in the default table): a down K that 256 does
# not divide (FP4 steps of 256, the last ragged: FP4_RAGGED_STEP; 64 / 128 without); their routers'
# particulars (Gemma-4's norm and per-expert scale) left out
OTHER_SHAPES = {"gemma-4-26b-a4b": (2816, 704, 128, 8, dict(activation="gelu_tanh")),
                "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4, dict(norm_topk_prob=False))}
TINY = {"tiny": (64, 64, 8, 2, dict(shared_intermediate_size=64)),
        "tiny-gpt-oss": (64, 32, 8, 2, SHAPES["gpt-oss-120b"][4])}
ALL_SHAPES = SHAPES | SWEEP_ONLY | OTHER_SHAPES | TINY
FORMATS = {"bf16": Format.BF16, "fp8": Format.FP8_BLOCK, "nvfp4": Format.NVFP4,
           "mxfp4": Format.MXFP4, "fp8_w8a8": Format.FP8_BLOCK}
# Formats whose layers also quantize the activations (MoEConfig's act_quant fields): W8A8
ACT_QUANT = {"fp8_w8a8": dict(gate_up_act_quant="fp8", down_act_quant="fp8")}
TOKENS = (1, 2, 3, 8, 32, 64)
ROTATE = 8  # input sets per timing loop

PALLAS = aj.KernelConfig(grouped_matmul="pallas", moe_path="decode")
XLA_DECODE = aj.KernelConfig(grouped_matmul="xla", moe_path="decode")
TRITON_DECODE = PALLAS.replace(decode_kernel="triton")  # --compare-triton
RAGGED_DOT = aj.KernelConfig(grouped_matmul="xla", moe_path="prefill")


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------


def make_weight(key, g: int, n: int, k: int, fmt: Format, chunk: int = 16) -> QTensor:
    """Random ``[g, n, k]`` weights in ``fmt``, quantized ``chunk`` experts at a time (the f32
    intermediates of a whole DeepSeek-V3 stack would not fit next to everything else)."""

    @jax.jit
    def part(i):
        w = jax.random.normal(jax.random.fold_in(key, i), (chunk, n, k), jnp.bfloat16)
        return quantize(w * (k**-0.5), fmt)

    parts = [part(i) for i in range(-(-g // chunk))]
    q = jax.tree.map(lambda *xs: jnp.concatenate(xs)[:g], *parts)
    return dataclasses.replace(q, shape=(g, n, k))


def make_layer(shape: str, fmt: Format | str, seed: int = 0) -> MoEParams:
    """The layer of ``shape`` in ``fmt`` (a Format, or a ``FORMATS`` name: ``fp8_w8a8`` adds
    the W8A8 activation quantization)."""
    h, i, e, k, extra = ALL_SHAPES[shape]
    quant = ACT_QUANT.get(fmt, {}) if isinstance(fmt, str) else {}
    fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
    cfg = MoEConfig(hidden_size=h, intermediate_size=i, num_experts=e, top_k=k,
                    expert_format=fmt, **extra, **quant)
    keys = jax.random.split(jax.random.key(seed), 8)

    def small(key, shape_, scale, dtype=jnp.bfloat16):
        return (jax.random.normal(key, shape_, jnp.float32) * scale).astype(dtype)

    s = cfg.shared_intermediate_size
    return MoEParams(
        shared_gate_up=make_weight(keys[7], 1, 2 * s, h, fmt).take(0) if s else None,
        shared_down=make_weight(jax.random.fold_in(keys[7], 1), 1, h, s, fmt).take(0)
        if s else None,
        router=small(keys[0], (e, h), h**-0.5),
        gate_up=make_weight(keys[1], e, 2 * i, h, fmt),
        down=make_weight(keys[2], e, h, i, fmt),
        router_bias=small(keys[3], (e,), 0.1) if cfg.router_bias else None,
        selection_bias=small(keys[4], (e,), 0.1, jnp.float32) if cfg.selection_bias else None,
        gate_up_bias=small(keys[5], (e, 2 * i), 0.1) if cfg.expert_bias else None,
        down_bias=small(keys[6], (e, h), 0.1) if cfg.expert_bias else None,
        config=cfg,
    )


def expert_bytes(params: MoEParams) -> float:
    """Bytes of one routed expert: gate_up and down data, scales and biases."""
    total = params.gate_up.nbytes + params.down.nbytes
    for b in (params.gate_up_bias, params.down_bias):
        if b is not None:
            total += b.size * b.dtype.itemsize
    return total / params.config.num_experts


def shared_bytes(params: MoEParams) -> float:
    """Bytes of the shared expert (0 without one): every step reads it."""
    if params.shared_gate_up is None:
        return 0.0
    return params.shared_gate_up.nbytes + params.shared_down.nbytes


def step_bytes(params: MoEParams, xs, per_expert: float, shared: float
               ) -> tuple[float, float]:
    """(distinct selected experts, weight bytes a step reads) averaged over the inputs ``xs``:
    the routed experts' bytes (``expert_bytes`` each) plus the shared expert's."""
    route = jax.jit(aj.moe.route)
    distinct = float(np.mean([len(np.unique(np.asarray(route(params, x).expert_ids)))
                              for x in xs]))
    return distinct, distinct * per_expert + shared


def token_sets(tokens: int, hidden: int, n: int = ROTATE) -> list[jax.Array]:
    return [jax.random.normal(jax.random.key(100 + j), (tokens, hidden), jnp.bfloat16)
            for j in range(n)]


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ---------------------------------------------------------------------------------------------
# step 1: correctness on the device
# ---------------------------------------------------------------------------------------------


def check_correctness(tiny: bool) -> list[dict]:
    """Kernel vs reference at 33 tokens (several row chunks) and 1 token (split-K tiles on
    the GPU), every format; moe_forward pallas vs XLA decode."""
    rows = []
    e, h, inter, k = (8, 64, 32, 2) if tiny else (16, 1024, 512, 4)
    for t in ((3,) if tiny else (33, 1)):
        rows += _check_kernels(e, h, inter, t, k)
    rows += _check_moe_forward(tiny)
    return rows


def _check_kernels(e, h, inter, t, k) -> list[dict]:
    rows = []
    rng = np.random.default_rng(0)
    ids = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(t)]), jnp.int32)
    ids = ids.at[0, -1].set(e)  # one zero expert
    weights = jnp.asarray(rng.uniform(size=(t, k)), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (t, h), jnp.bfloat16)
    on_gpu = device_sm_count() is not None
    for name, fmt in FORMATS.items():
        gu = make_weight(jax.random.key(2), e, 2 * inter, h, fmt)
        dn = make_weight(jax.random.key(3), e, h, inter, fmt)
        kw = dict(fmt=fmt.value, gate_up_scale=gu.scale, gate_up_global_scale=gu.global_scale,
                  down_scale=dn.scale, down_global_scale=dn.global_scale,
                  activation="gpt_oss", gate_up_layout="interleaved", **ACT_QUANT.get(name, {}))
        if fmt is Format.FP8_BLOCK:
            kw["block_size"] = gu.block
        ref = moe_decode_reference(x, ids, weights, gu.data, dn.data, **kw)
        base = choose_decode_config(t, k, e, h, inter, fmt.value, fp8_block=gu.block,
                                    sm_count=device_sm_count(), device_kind=device_kind(),
                                    **ACT_QUANT.get(name, {}))
        variants = {"heuristic": base}
        if fmt is not Format.BF16 and name not in ACT_QUANT:  # the f16-dot route, or not
            for f16 in (False, True):
                variants[f"f16_dot={f16}"] = MoEDecodeConfig(
                    dataclasses.replace(base.gate_up, f16_dot=f16),
                    dataclasses.replace(base.down, f16_dot=f16))
        for label, config in variants.items():
            out = moe_decode(x, ids, weights, gu.data, dn.data, config=config,
                             interpret=not on_gpu, **kw)
            err = rel_err(out, ref)
            ok = bool(np.isfinite(np.asarray(out)).all()) and err < 1e-2
            rows.append(dict(check="kernel vs reference", format=name, config=label, T=t,
                             split_k=f"{config.gate_up.split_k}/{config.down.split_k}",
                             rel_err=err, ok="yes" if ok else "NO"))
    return rows


def _check_moe_forward(tiny: bool) -> list[dict]:
    rows = []
    shapes = list(TINY) if tiny else ["qwen3-30b-a3b"]
    for shape in shapes:
        for name in ("bf16", "nvfp4", "fp8_w8a8"):
            p = make_layer(shape, name)
            xx = token_sets(8, p.config.hidden_size, 1)[0]
            f = jax.jit(aj.moe_forward, static_argnames="kernels")
            err = rel_err(f(p, xx, kernels=PALLAS), f(p, xx, kernels=XLA_DECODE))
            ok = err < 1e-2
            rows.append(dict(check=f"moe_forward {shape}", format=name, config="pallas vs xla",
                             T=8, split_k="", rel_err=err, ok="yes" if ok else "NO"))
    return rows


# ---------------------------------------------------------------------------------------------
# step 2: timings
# ---------------------------------------------------------------------------------------------


def _time(kernels, params, xs, loops, host: bool = False, busy: bool = False):
    """Seconds per full decode step inside one jitted scan (``time_scan``); with ``host``
    seconds per call dispatched from Python one step at a time (what an un-captured loop pays);
    with ``busy`` (seconds, launches) of GPU activity per step (``device_busy``). Errors (e.g.
    out of memory) come back as text for the table."""
    try:
        if host or busy:
            step = rotating(jax.jit(functools.partial(aj.moe_forward, kernels=kernels)),
                            params, xs)
            if busy:
                return device_busy(step), None
            return time_jax(step, iters=20, repeats=5, warmup=2), None
        step = functools.partial(aj.moe_forward, kernels=kernels)
        return time_scan(step, params, xs, loops=loops), None
    except Exception as err:  # report in the table, do not hide
        return None, f"{type(err).__name__}: {str(err)[:60]}"


def bench(shapes, formats, token_counts, *, hbm: float, loops: int,
          peer_formats: list[str], compare_triton: bool = False,
          step_repeats: int = 1) -> list[dict]:
    """One row a (shape, format, tokens). ``step_repeats`` > 1: the step is timed that many
    times, once before the case's other timings and the rest after them; ``us`` is the
    median, ``us_range`` the smallest and the largest (the spread METHOD.md asks for)."""
    rows = []
    for shape in shapes:
        for name in formats:
            p = make_layer(shape, name)
            per_expert, shared = expert_bytes(p), shared_bytes(p)
            for tokens in token_counts:
                xs = token_sets(tokens, p.config.hidden_size)
                distinct, nbytes = step_bytes(p, xs, per_expert, shared)
                row = dict(shape=shape, format=name, tokens=tokens, experts=distinct,
                           MB=nbytes / 1e6)
                t, err = _time(PALLAS, p, xs, loops)
                if t is None:
                    row["us"] = err
                    rows.append(row)
                    continue
                row["bound_us"] = (nbytes / hbm + 10e-6) * 1e6
                tt = None
                if compare_triton:  # the Triton decode kernels on the same step
                    tt, err = _time(TRITON_DECODE, p, xs, loops)
                    row["triton_us"] = tt * 1e6 if tt else err
                    bt, _ = _time(TRITON_DECODE, p, xs, loops, busy=True)
                    if bt:
                        row["triton_busy_us"] = bt[0] * 1e6
                th, err = _time(PALLAS, p, xs, loops, host=True)
                row["host_us"] = th * 1e6 if th else err
                busy, err = _time(PALLAS, p, xs, loops, busy=True)
                if busy:
                    row.update(busy_us=busy[0] * 1e6, launches=busy[1],
                               busy_frac_hbm=nbytes / busy[0] / hbm)
                times = [t] + [_time(PALLAS, p, xs, loops)[0] for _ in range(step_repeats - 1)]
                times = [v for v in times if v is not None]
                t = float(np.median(times))
                row.update(us=t * 1e6, GBps=nbytes / t / 1e9, frac_hbm=nbytes / t / hbm)
                if step_repeats > 1:
                    row["us_range"] = f"{min(times) * 1e6:.3g}-{max(times) * 1e6:.3g}"
                if tt:
                    row["vs_triton"] = tt / t
                if name in peer_formats:
                    for label, kc in (("ragged_dot", RAGGED_DOT), ("xla_decode", XLA_DECODE)):
                        # the XLA paths take 0.1-30 ms a step: fewer loops
                        tp, err = _time(kc, p, xs, 1)
                        row[f"{label}_us"] = tp * 1e6 if tp else err
                        if tp:
                            row[f"vs_{label}"] = tp / t
                        pb, _ = _time(kc, p, xs, 1, busy=True)
                        if pb and busy:
                            row[f"busy_vs_{label}"] = pb[0] / busy[0]
                rows.append(row)
                print(table([row], list(row)), flush=True)
            del p
            gc.collect()
    return rows


SHARED_COLUMNS = ["shape", "format", "tokens", "shared_MB", "shared_bound_us", "rule",
                  "step_folded_us", "step_own_path_us", "step_no_shared_us", "shared_folded_us",
                  "shared_own_path_us", "kernels_us", "xla_dense_us"]


def bench_shared(shapes, formats, token_counts, *, hbm: float, loops: int) -> list[dict]:
    """What the shared expert costs: the step with it folded into the routed launches (where
    ``moe.experts.shared_folds`` allows it; ``rule`` says which path moe_forward takes) and with
    it on its own path (the A/B of that rule), without it, and the shared expert alone
    through the decode kernels as a one-expert stack (moe_forward's own path for FP4 shared
    experts) and through XLA's dense path."""
    from unittest import mock

    from atlas_jax.moe import experts
    from atlas_jax.moe.experts import shared_experts

    step = functools.partial(aj.moe_forward, kernels=PALLAS)
    rows = []
    for shape in shapes:
        if not ALL_SHAPES[shape][4].get("shared_intermediate_size"):
            continue
        for name in formats:
            p = make_layer(shape, name)
            bare = dataclasses.replace(
                p, shared_gate_up=None, shared_down=None,
                config=dataclasses.replace(p.config, shared_intermediate_size=0))
            sb = shared_bytes(p)
            for tokens in token_counts:
                xs = token_sets(tokens, p.config.hidden_size)
                folds = experts.shared_folds(p, tokens, PALLAS)
                row = dict(shape=shape, format=name, tokens=tokens, shared_MB=sb / 1e6,
                           shared_bound_us=sb / hbm * 1e6,
                           rule="folded" if folds else "own path")
                shared = functools.partial(shared_experts, kernels=PALLAS)
                timings = [("step_own_path_us", step, p, True),
                           ("step_no_shared_us", step, bare, False),
                           ("kernels_us", functools.partial(shared, decode=True), p, False),
                           ("xla_dense_us", functools.partial(shared, decode=False), p, False)]
                if folds:
                    timings.insert(0, ("step_folded_us", step, p, False))
                else:
                    row["step_folded_us"] = "n/a (rule: own path)"
                for label, fn, params, own_path in timings:
                    # own path: the rule's token bound set to 0, so it never folds
                    rule = (mock.patch.object(experts, "SHARED_FOLD_MAX_TOKENS", 0) if own_path
                            else contextlib.nullcontext())
                    try:
                        with rule:
                            row[label] = time_scan(fn, params, xs, loops=loops) * 1e6
                    except Exception as err:  # report in the table, do not hide
                        row[label] = f"{type(err).__name__}: {str(err)[:60]}"
                for path in ("folded", "own_path"):
                    if all(isinstance(row.get(c), float)
                           for c in (f"step_{path}_us", "step_no_shared_us")):
                        row[f"shared_{path}_us"] = (row[f"step_{path}_us"]
                                                    - row["step_no_shared_us"])
                rows.append(row)
                print(table([row], list(row)), flush=True)
            del p, bare
            gc.collect()
    return rows


def sweep(shapes, formats, token_counts, *, hbm: float, loops: int,
          only: list[str] | None = None) -> list[dict]:
    """The kernels alone (routing precomputed) with tile variants around the heuristic's
    (``only``: just these variants besides the heuristic's)."""
    rows, seen = [], set()
    for shape in shapes:
        for name in formats:
            p = make_layer(shape, name)
            cfg = p.config
            per_expert = expert_bytes(p)
            gu, dn = p.gate_up, p.down
            static = dict(fmt=gu.format.value, activation=cfg.activation.value,
                          gate_up_layout=cfg.gate_up_layout.value, limit=cfg.swiglu_limit,
                          interpret=device_sm_count() is None, **ACT_QUANT.get(name, {}))
            if gu.format is Format.FP8_BLOCK:
                static["block_size"] = gu.block
            arrays = dict(gate_up_scale=gu.scale, gate_up_global_scale=gu.global_scale,
                          gate_up_bias=p.gate_up_bias, down_scale=dn.scale,
                          down_global_scale=dn.global_scale, down_bias=p.down_bias)
            for tokens in token_counts:
                xs = token_sets(tokens, cfg.hidden_size)
                routes = [aj.moe.route(p, x) for x in xs]
                distinct = np.mean([len(np.unique(np.asarray(r.expert_ids))) for r in routes])
                base = choose_decode_config(
                    tokens, cfg.top_k, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size,
                    gu.format.value, fp8_block=gu.block, sm_count=device_sm_count(),
                    device_kind=device_kind(), **ACT_QUANT.get(name, {}))
                inputs = [(x, r.expert_ids, r.weights) for x, r in zip(xs, routes, strict=True)]
                variants = _variants(base)
                seen.update(variants)
                for label, config in variants.items():
                    if only and label != "heuristic" and label not in only:
                        continue
                    fn = functools.partial(moe_decode, config=config, **static)

                    def run(consts, inp, fn=fn):
                        return fn(*inp, consts[0], consts[1], **consts[2])

                    try:
                        t = time_scan(run, (gu.data, dn.data, arrays), inputs, loops=loops)
                    except Exception as err:  # report, do not hide: the table says why
                        rows.append(dict(shape=shape, format=name, tokens=tokens, variant=label,
                                         us=f"{type(err).__name__}: {str(err)[:80]}"))
                        continue
                    rows.append(dict(shape=shape, format=name, tokens=tokens, variant=label,
                                     us=t * 1e6, frac_hbm=distinct * per_expert / t / hbm))
                    print(table([rows[-1]], list(rows[-1])), flush=True)
            del p
            gc.collect()
    unknown = sorted(set(only or ()) - seen)
    if unknown:
        sys.exit(f"--variants: no sweep variant named {unknown}; the variants: {sorted(seen)}")
    return rows


def _variants(base: MoEDecodeConfig) -> dict[str, MoEDecodeConfig]:
    out = {"heuristic": base}

    def both(**changes):
        return MoEDecodeConfig(dataclasses.replace(base.gate_up, **changes),
                               dataclasses.replace(base.down, **changes))

    for bn_scale in (0.5, 2):
        gu_bn = int(base.gate_up.block_n * bn_scale)
        dn_bn = int(base.down.block_n * bn_scale)
        if 16 <= gu_bn <= 256 and 16 <= dn_bn <= 256:
            out[f"block_n x{bn_scale}"] = MoEDecodeConfig(
                dataclasses.replace(base.gate_up, block_n=gu_bn),
                dataclasses.replace(base.down, block_n=dn_bn))
    for stages in (2, 3):
        if stages != base.gate_up.num_stages:
            out[f"stages={stages}"] = both(num_stages=stages)
    other_warps = 4 if base.down.num_warps == 8 else 8
    out[f"warps={other_warps}"] = both(num_warps=other_warps)
    if base.gate_up.f16_dot:
        out["bf16 dots"] = both(f16_dot=False)
    if base.gate_up.block_k == 128:
        out["block_k=64"] = both(block_k=64)
    out["split_k=1"] = both(split_k=1)
    for f in (2, 4):
        out[f"split_k x{f}"] = MoEDecodeConfig(
            dataclasses.replace(base.gate_up, split_k=f * base.gate_up.split_k),
            dataclasses.replace(base.down, split_k=f * base.down.split_k))
    out["block_n/2, split_k x2"] = MoEDecodeConfig(
        dataclasses.replace(base.gate_up, block_n=max(16, base.gate_up.block_n // 2),
                            split_k=2 * base.gate_up.split_k),
        dataclasses.replace(base.down, block_n=max(16, base.down.block_n // 2),
                            split_k=2 * base.down.split_k))
    out["down split only"] = MoEDecodeConfig(dataclasses.replace(base.gate_up, split_k=1),
                                             base.down)
    for f in (2, 4):
        out[f"gate_up split x{f}"] = MoEDecodeConfig(
            dataclasses.replace(base.gate_up, split_k=f), dataclasses.replace(base.down,
                                                                              split_k=1))
    out["block_n=32, split_k=1"] = both(block_n=32, split_k=1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes, interpret mode off GPU (a smoke test of the script)")
    parser.add_argument("--quick", action="store_true", help="1, 8, 64 tokens; bf16, nvfp4")
    parser.add_argument("--shapes", nargs="+", choices=list(ALL_SHAPES))
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS))
    parser.add_argument("--tokens", nargs="+", type=int)
    parser.add_argument("--no-peers", action="store_true", help="time the Pallas path only")
    parser.add_argument("--peer-formats", nargs="+", choices=list(FORMATS),
                        help="formats timed with the XLA peers too (default: all timed)")
    parser.add_argument("--no-shared", action="store_true",
                        help="skip the shared-expert section (DeepSeek-V3 shape)")
    parser.add_argument("--sweep", action="store_true", help="also time tile variants")
    parser.add_argument("--variants", nargs="+", metavar="NAME",
                        help="--sweep: only these variants besides the heuristic's (names as "
                             "in the sweep table, e.g. 'bf16 dots' 'split_k x2')")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--compare-triton", action="store_true",
                        help="also time each step on the Triton decode kernels "
                             "(KernelConfig.decode_kernel='triton'; 'auto' takes Mosaic GPU "
                             "for FP8 on sm_90)")
    parser.add_argument("--decode-kernel", choices=["auto", "triton", "mosaic"], default="auto",
                        help="KernelConfig.decode_kernel of the timed Pallas steps")
    parser.add_argument("--step-repeats", type=int, default=1, metavar="N",
                        help="time each step N times, spread over the case's other timings; "
                             "report the median and the range (us_range)")
    parser.add_argument("--out", type=Path, help="write the markdown tables here")
    args = parser.parse_args()
    if args.step_repeats < 1:
        parser.error("--step-repeats must be >= 1")
    global PALLAS
    PALLAS = PALLAS.replace(decode_kernel=args.decode_kernel)
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.tiny:
        sys.exit("benchmarks/moe_decode.py needs a GPU (or --tiny for a CPU smoke test)")
    shapes = args.shapes or (list(TINY) if args.tiny else list(SHAPES))
    formats = args.formats or (["bf16", "nvfp4"] if args.quick or args.tiny else
                               ["bf16", "nvfp4", "mxfp4", "fp8"])
    token_counts = args.tokens or ((1, 2, 3) if args.tiny else
                                   (1, 8, 64) if args.quick else TOKENS)
    loops = 1 if args.tiny else 8
    device = jax.devices()[0]
    lines = [f"## moe_decode ({datetime.date.today()}, {device.device_kind}, jax "
             f"{jax.__version__}{', interpret mode' if not on_gpu else ''})", ""]
    if not args.skip_check:
        check = check_correctness(args.tiny)
        lines += ["### Correctness (kernel vs reference; moe_forward pallas vs XLA decode)", "",
                  table(check, list(check[0])), ""]
        print("\n".join(lines), flush=True)
        bad = [r for r in check if r["ok"] != "yes"]
        if bad:
            print(f"{len(bad)} correctness failures", flush=True)
    hbm = hbm_copy_bandwidth(0.0625 if args.tiny else 4.0)
    peer_formats = [] if args.no_peers else (args.peer_formats or formats)
    rows = bench(shapes, formats, token_counts, hbm=hbm, loops=loops, peer_formats=peer_formats,
                 compare_triton=args.compare_triton, step_repeats=args.step_repeats)
    cols = ["shape", "format", "tokens", "experts", "MB", "us", "us_range", "bound_us",
            "triton_us",
            "vs_triton", "triton_busy_us", "host_us", "busy_us",
            "launches", "GBps", "frac_hbm", "busy_frac_hbm", "ragged_dot_us", "vs_ragged_dot",
            "busy_vs_ragged_dot", "xla_decode_us", "vs_xla_decode", "busy_vs_xla_decode"]
    lines += [f"HBM copy {hbm / 1e12:.2f} TB/s (measured in this run). Full moe_forward decode "
              "steps: `us` per step inside one jitted scan; `host_us` one jitted call per step "
              "from Python, dispatch included; `busy_us` the GPU time of the step's kernels and "
              "copies (CUPTI via torch.profiler; `launches` per step), the floor of a CUDA-graph "
              "replay; busy_vs_* the same ratio for the peers' busy time; MB = weight bytes of "
              "the distinct selected experts plus the shared expert; bound = MB / HBM + 10 us.",
              "",
              table(rows, cols), ""]
    if not args.no_shared:
        shrows = bench_shared(shapes, formats, token_counts, hbm=hbm, loops=loops)
        if shrows:
            lines += ["### Shared expert (decode kernels as a one-expert stack vs XLA dense)", "",
                      table(shrows, SHARED_COLUMNS), ""]
    if args.sweep:
        srows = sweep(shapes, formats, token_counts, hbm=hbm, loops=loops, only=args.variants)
        lines += ["### Tile sweep (kernels alone, routing precomputed)", "",
                  table(srows, ["shape", "format", "tokens", "variant", "us", "frac_hbm"]), ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
