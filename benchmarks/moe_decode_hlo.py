"""Launch inventory of one jitted ``moe_forward`` decode step: the ENTRY instructions of the
compiled (optimized) HLO by opcode, i.e. the kernels XLA launches per step on the GPU; with
``--profile`` also each kernel's GPU time per step (CUPTI through torch.profiler); with
``--timeline`` where a step's time goes between its launches, for the step inside a rolled
``lax.scan`` (as ``moe_decode.py`` times it), a scan unrolled 4 steps an iteration, and the
steps unrolled in straight-line code (as a model's layers are): wall time a step, GPU busy
time, the idle gaps between launches, device-to-host copies (the while loop's predicate), and
the launches with the longest idle time before them.

    python benchmarks/moe_decode_hlo.py [--tokens 1 2 3] [--shape S] [--format F] [--profile]
        [--timeline] [--set "NAME=VALUE ..."]

``--set`` takes one arm of ``moe_decode_arms.py`` (its constants set for the whole run).
"""

from __future__ import annotations

import argparse
import collections
import functools
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import atlas_jax as aj  # noqa: E402
from benchmarks._common import (  # noqa: E402
    device_kernels,
    device_timeline,
    rotating,
    scan_program,
    table,
    time_jax,
)
from benchmarks.moe_decode import FORMATS, PALLAS, make_layer, token_sets  # noqa: E402
from benchmarks.moe_decode_arms import arm_argument, set_constants  # noqa: E402


def entry_ops(hlo: str) -> collections.Counter:
    entry = hlo[hlo.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    ops = collections.Counter()
    for line in entry.splitlines()[1:]:
        m = re.search(r"=\s*\S+\s+([a-z\-]+)\(", line)
        if m and m.group(1) not in ("parameter", "constant", "get-tuple-element", "tuple",
                                    "bitcast"):
            ops[m.group(1)] += 1
    return ops


def _programs(step):
    """The step over stacked inputs ``xx`` as one jitted program, three ways."""

    def unrolled(c, xx):
        return [step(c, xx[i]) for i in range(xx.shape[0])]

    def scan4(c, xx):
        return jax.lax.scan(lambda carry, x: (carry, step(c, x)), 0, xx, unroll=4)[1]

    return {"scan": scan_program(step), "scan unroll 4": jax.jit(scan4),
            "straight-line": jax.jit(unrolled)}


def timeline_rows(step, consts, xs, loops: int = 2) -> list[dict]:
    """Per program form (``_programs``): wall us a step (``time_jax`` over one call of all the
    steps), and from the GPU timeline the busy us a step, the idle us between launches inside
    a call, device-to-host copies a step and the three launches with the most idle time before
    them (us a step)."""
    stacked = jnp.stack(list(xs) * loops)
    steps = stacked.shape[0]
    rows = []
    for form, prog in _programs(step).items():
        wall = time_jax(prog, consts, stacked, iters=1, repeats=5, warmup=1) / steps
        calls = 3
        events = device_timeline(prog, consts, stacked, calls=calls)
        if events is None:
            sys.exit("--timeline needs torch (CUPTI through torch.profiler)")
        n = calls * steps
        busy = sum(end - start for _, start, end in events)
        idle_before = collections.Counter()
        idle = 0.0
        for (_, _, prev_end), (name, start, _) in zip(events, events[1:], strict=False):
            gap = start - prev_end
            if 0 < gap < 1000:  # longer: between calls (the host waits for the result)
                idle += gap
                idle_before[name[:40]] += gap
        copies = sum("memcpy" in name.lower() for name, _, _ in events)
        rows.append(dict(form=form, wall_us=wall * 1e6, busy_us=busy / n, idle_us=idle / n,
                         launches=len(events) / n, d2h=copies / n,
                         most_idle_before=", ".join(f"{k} {v / n:.2f}"
                                                    for k, v in idle_before.most_common(3))))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--format", default="bf16", choices=list(FORMATS))
    parser.add_argument("--profile", action="store_true",
                        help="GPU time of each kernel per step (needs torch)")
    parser.add_argument("--timeline", action="store_true",
                        help="where a step's time goes between launches (needs torch)")
    parser.add_argument("--set", type=arm_argument, default="", metavar="ARM",
                        help="constants to set first, as one arm of moe_decode_arms.py")
    args = parser.parse_args()
    set_constants(args.set)
    p = make_layer(args.shape, args.format)
    step = jax.jit(aj.moe_forward, static_argnames="kernels")
    for t in args.tokens:
        x = jnp.zeros((t, p.config.hidden_size), jnp.bfloat16)
        hlo = step.lower(p, x, kernels=PALLAS).compile().as_text()
        ops = entry_ops(hlo)
        print(f"T={t}: {sum(ops.values())} ENTRY ops: {dict(ops.most_common())}")
        for line in hlo[hlo.index("\nENTRY"):].splitlines()[1:]:
            if re.search(r"\b(fusion|custom-call|sort|scatter|gather|while|copy)\(", line):
                print("   ", line.strip()[:160])
        if args.profile:
            xs = token_sets(t, p.config.hidden_size)
            call = rotating(functools.partial(step, kernels=PALLAS), p, xs)
            kernels = device_kernels(call, by_order=True)
            if kernels is None:
                sys.exit("--profile needs torch (CUPTI through torch.profiler)")
            total = sum(s for _, s, _ in kernels)
            print(f"T={t}: {total * 1e6:.1f} us GPU time per step in "
                  f"{sum(n for _, _, n in kernels):.0f} launches")
            print(table([dict(kernel=name[:70], us=s * 1e6, launches=n)
                         for name, s, n in kernels], ["kernel", "us", "launches"]))
        if args.timeline:
            rows = timeline_rows(functools.partial(step, kernels=PALLAS), p,
                                 token_sets(t, p.config.hidden_size))
            print(f"T={t} timeline:")
            print(table(rows, ["form", "wall_us", "busy_us", "idle_us", "launches", "d2h",
                               "most_idle_before"]))


if __name__ == "__main__":
    main()
