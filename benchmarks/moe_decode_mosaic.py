"""MoE decode experts on the H200: the Mosaic GPU launches (weights as the wgmma's register A
operand, ``pallas_kernels/moe_decode/mosaic.py``) against the Triton decode kernels
(``kernel.moe_decode``), same routing, same layer.

Each case times the routed experts of one decode step (plan, both launches, the glue and the
k-way combine; no router, no shared expert) inside one jitted scan over 8 rotating input sets
(``time_scan``), and the GPU busy time (CUPTI). MB counts the distinct selected experts'
weights and scales; ``frac_hbm`` is MB / time over the HBM copy bandwidth measured in the same
run. A correctness step first compares both paths with the plain-jnp reference on the GPU.

    python benchmarks/moe_decode_mosaic.py [--shapes ...] [--formats fp8 bf16] [--tokens ...]
                                           [--stages 2 3 4 6] [--k-splits 1,1 auto 2,2]
                                           [--profile] [--out FILE]
    python benchmarks/moe_decode_mosaic.py --timeline [--shapes ...] [--formats ...] [--tokens ..]
                                           [--set "NAME=VALUE ..."]

``--timeline`` times nothing: it runs the one launch (``slot_mlp``, f16 activations) with its
programs' clock stamps and prints, per phase (gate_up, h, down programs) and per work item,
when programs started, ended their waits and ended (us from the launch's first start).
``--set`` takes one arm of ``moe_decode_arms.py``: module constants set for the whole run.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from atlas_jax.ops.activation import GateUp  # noqa: E402
from atlas_jax.ops.moe_decode import _weight_kwargs  # noqa: E402
from benchmarks._common import (  # noqa: E402
    device_busy,
    device_kernels,
    hbm_copy_bandwidth,
    table,
    time_scan,
)
from benchmarks.moe_decode import SHAPES, make_layer, rel_err  # noqa: E402
from benchmarks.moe_decode_arms import arm_argument, set_constants  # noqa: E402
from pallas_kernels.moe_decode import moe_decode, moe_decode_pairs_reference  # noqa: E402
from pallas_kernels.moe_decode.mosaic import (  # noqa: E402
    choose_item_rows,
    choose_slot_tile,
    moe_decode_mosaic_pairs,
)

ROTATE = 8
WEIGHT_FORMATS = ("fp8", "bf16", "nvfp4", "mxfp4")  # benchmarks.moe_decode's format names
_STATIC = ("fmt", "activation", "gate_up_layout", "limit", "block_size", "interpret")


def _layer_args(shape: str, fmt: str):
    """(arrays, static keywords) of the routed experts of ``shape`` in ``fmt``: the keywords
    ``moe_forward``'s decode variant passes both kernel families (``_weight_kwargs``)."""
    p = make_layer(shape, fmt)
    cfg = p.config
    kw = _weight_kwargs(p.gate_up, p.down, None, GateUp.of(cfg))
    static = {name: kw.pop(name) for name in _STATIC if name in kw}
    arrays = dict(kw, gate_up=p.gate_up.data, down=p.down.data, gate_up_bias=p.gate_up_bias,
                  down_bias=p.down_bias)
    nbytes = (p.gate_up.nbytes + p.down.nbytes) / cfg.num_experts
    return arrays, static, nbytes, cfg


def _inputs(cfg, tokens: int, n: int = ROTATE):
    xs = []
    for j in range(n):
        kx, ki = jax.random.split(jax.random.key(100 + j))
        x = jax.random.normal(kx, (tokens, cfg.hidden_size), jnp.bfloat16)
        logits = jax.random.normal(ki, (tokens, cfg.num_experts))
        w, ids = jax.lax.top_k(logits, cfg.top_k)
        xs.append((x, ids.astype(jnp.int32), jax.nn.softmax(w, axis=-1)))
    return xs


def _steps(fmt: str, static: dict, tiles=None, k_splits="auto"):
    def triton(arrays, inp):
        x, ids, w = inp
        return moe_decode(x, ids, w, **arrays, **static)

    def mosaic(arrays, inp):
        x, ids, w = inp
        pairs = moe_decode_mosaic_pairs(x, ids, **arrays, **static, tile=tiles,
                                        k_splits=k_splits)
        return jnp.sum(w[..., None] * pairs, axis=1)

    return triton, mosaic


def check(shapes, formats) -> list[dict]:
    rows = []
    for shape in shapes:
        for fmt in formats:
            arrays, static, _, cfg = _layer_args(shape, fmt)
            triton, mosaic = _steps(fmt, static)
            for tokens in (1, 8, 33, 64):
                inp = _inputs(cfg, tokens, 1)[0]
                x, ids, w = inp
                ref = moe_decode_pairs_reference(x, ids, **arrays, **static)
                ref = jnp.sum(w[..., None] * ref, axis=1)
                out_m = jax.jit(mosaic)(arrays, inp)
                out_t = jax.jit(triton)(arrays, inp)
                rows.append(dict(shape=shape, format=fmt, tokens=tokens,
                                 mosaic_vs_ref=rel_err(out_m, ref),
                                 triton_vs_ref=rel_err(out_t, ref),
                                 mosaic_nan=bool(np.isnan(np.asarray(out_m)).any())))
                print(table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def bench(shapes, formats, token_counts, stages, *, hbm: float, profile: bool = False,
          k_splits=("auto",)) -> list[dict]:
    rows = []
    for shape in shapes:
        for fmt in formats:
            arrays, static, per_expert, cfg = _layer_args(shape, fmt)
            for tokens in token_counts:
                xs = _inputs(cfg, tokens)
                distinct = np.mean([len(np.unique(np.asarray(ids))) for _, ids, _ in xs])
                nbytes = distinct * per_expert
                row = dict(shape=shape, format=fmt, tokens=tokens, experts=distinct,
                           MB=nbytes / 1e6)
                variants = {"triton": _steps(fmt, static)[0]}
                for s, splits in itertools.product(stages, k_splits):
                    r = choose_item_rows(tokens, fmt, tokens * cfg.top_k / cfg.num_experts)
                    tiles = (choose_slot_tile(cfg.hidden_size, s, fmt, rows=r),
                             choose_slot_tile(cfg.intermediate_size, s, fmt, rows=r))
                    name = f"mosaic_s{s}" + ("" if splits == "auto" else
                                             "_k" + "x".join(map(str, splits)))
                    variants[name] = _steps(fmt, static, tiles, splits)[1]
                for name, fn in variants.items():
                    try:
                        t = time_scan(fn, arrays, xs)
                        row[f"{name}_us"] = t * 1e6
                        row[f"{name}_frac"] = nbytes / t / hbm
                        call = functools.partial(jax.jit(fn), arrays)
                        busy = device_busy(call, xs[0])
                        if profile:
                            launches = device_kernels(call, xs[0], by_order=True) or []
                            for kname, sec, count in launches:
                                print(f"  {name} {tokens} tok: {sec * 1e6:7.2f} us x{count:g} "
                                      f"{kname[:90]}")
                        if busy:
                            row[f"{name}_busy_us"] = busy[0] * 1e6
                            row[f"{name}_busy_frac"] = nbytes / busy[0] / hbm
                    except Exception as err:  # report in the table, do not hide
                        row[f"{name}_us"] = f"{type(err).__name__}: {str(err)[:80]}"
                rows.append(row)
                print(table([row], list(row)), flush=True)
    return rows


def timeline_summary(stamps: np.ndarray) -> str:
    """``slot_mlp``'s stamps (``TIMELINE_COLUMNS``) -> a table a phase and one an item (us from
    the first start; 'waited' = the end of a program's wait, its start if it has none)."""
    t = stamps.astype(np.int64)
    # 32-bit clock differences from program 0, signed: other SMs' programs may start first
    rel = (t[:, :3] - t[0, 0] + (1 << 31)) % (1 << 32) - (1 << 31)
    start, waited, end = ((rel - rel[:, 0].min()) / 1e3).T
    phase, item = t[:, 4], t[:, 5]
    rows = []
    for p, name in enumerate(("gate_up", "h", "down")):
        at = phase == p
        s_, w_, e_ = start[at], waited[at], end[at]
        rows.append(dict(phase=name, programs=int(at.sum()), first_start=s_.min(),
                         last_start=s_.max(), median_wait=np.median(w_ - s_),
                         median_run=np.median(e_ - w_), first_end=e_.min(), last_end=e_.max()))
    item_rows = []
    for u in np.unique(item):
        gu, h, dn = ((item == u) & (phase == p) for p in range(3))
        item_rows.append(dict(item=int(u), gate_up_last_end=end[gu].max(),
                              h_waited=waited[h].max(), h_end=end[h].max(),
                              down_first_start=start[dn].min(),
                              down_last_waited=waited[dn].max(), down_last_end=end[dn].max()))
    return table(rows, list(rows[0])) + "\n\n" + table(item_rows, list(item_rows[0]))


def timelines(shapes, formats, token_counts, calls: int = 4) -> str:
    """Each case's one launch, ``calls`` times over the rotating inputs; the last call's
    stamps summarized (``timeline_summary``)."""
    out = []
    for shape in shapes:
        for fmt in formats:
            if fmt == "bf16":
                continue  # the one launch takes f16 activations
            arrays, static, _, cfg = _layer_args(shape, fmt)
            step = jax.jit(lambda arrays, x, ids, static=static: moe_decode_mosaic_pairs(
                x, ids, **arrays, **static, fused=True, timeline=True))
            for tokens in token_counts:
                xs = _inputs(cfg, tokens)
                for j in range(calls):
                    x, ids, _ = xs[j % len(xs)]
                    _, stamps = step(arrays, x, ids)
                rows = choose_item_rows(tokens, fmt, tokens * cfg.top_k / cfg.num_experts)
                text = (f"{shape} {fmt} {tokens} tokens, items of {rows} rows\n\n"
                        + timeline_summary(np.asarray(stamps)))
                print(text + "\n", flush=True)
                out.append(text)
    return "\n\n".join(out)


def _splits(text: str):
    if text == "auto":
        return text
    try:
        gate_up, down = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'G,D' or 'auto', got {text!r}") from None
    return gate_up, down


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b"], choices=list(SHAPES))
    parser.add_argument("--formats", nargs="+", default=["fp8", "bf16"],
                        choices=WEIGHT_FORMATS)
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--stages", nargs="+", type=int, default=[4])
    parser.add_argument("--k-splits", nargs="+", type=_splits, default=["auto"],
                        help="K splits of the Mosaic launches, each 'G,D' (gate_up, down) or "
                             "'auto' (choose_k_splits, the default), e.g. --k-splits auto 1,1 2,2")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="print each variant's kernels with their GPU time")
    parser.add_argument("--timeline", action="store_true",
                        help="the one launch's per-program clock stamps, summarized; no timing")
    parser.add_argument("--set", type=arm_argument, default="", metavar="ARM",
                        help="constants to set first, as one arm of moe_decode_arms.py")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    set_constants(args.set)
    print(f"{datetime.date.today()} {jax.devices()[0].device_kind}", flush=True)
    if args.timeline:
        text = timelines(args.shapes, args.formats, args.tokens)
        if args.out:
            args.out.write_text(text + "\n")
        return
    out = []
    if not args.skip_check:
        out.append(table(check(args.shapes, args.formats),
                         ["shape", "format", "tokens", "mosaic_vs_ref", "triton_vs_ref",
                          "mosaic_nan"]))
    hbm = hbm_copy_bandwidth()
    print(f"HBM copy {hbm / 1e12:.2f} TB/s", flush=True)
    rows = bench(args.shapes, args.formats, args.tokens, args.stages, hbm=hbm,
                 profile=args.profile, k_splits=args.k_splits)
    cols = list(dict.fromkeys(c for r in rows for c in r))  # first seen first (per format)
    out.append(f"HBM copy {hbm / 1e12:.2f} TB/s\n\n" + table(rows, cols))
    text = "\n\n".join(out)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
