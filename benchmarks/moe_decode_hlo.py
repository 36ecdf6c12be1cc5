"""Launch inventory of one jitted ``moe_forward`` decode step: the ENTRY instructions of the
compiled (optimized) HLO by opcode, i.e. the kernels XLA launches per step on the GPU; with
``--profile`` also each kernel's GPU time per step (CUPTI through torch.profiler).

    python benchmarks/moe_decode_hlo.py [--tokens 1 2 3] [--shape S] [--format F] [--profile]
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
from benchmarks._common import device_kernels, rotating, table  # noqa: E402
from benchmarks.moe_decode import FORMATS, PALLAS, make_layer, token_sets  # noqa: E402


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--format", default="bf16", choices=list(FORMATS))
    parser.add_argument("--profile", action="store_true",
                        help="GPU time of each kernel per step (needs torch)")
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
