"""Launch inventory of one jitted ``moe_forward`` decode step: the ENTRY instructions of the
compiled (optimized) HLO by opcode, i.e. the kernels XLA launches per step on the GPU.

    python benchmarks/moe_decode_hlo.py [--tokens 1 2 3]    # on the GPU (Qwen3-30B-A3B BF16)
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import atlas_jax as aj  # noqa: E402
from benchmarks.moe_decode import FORMATS, PALLAS, make_layer  # noqa: E402


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
    args = parser.parse_args()
    p = make_layer(args.shape, FORMATS[args.format])
    step = jax.jit(aj.moe_forward, static_argnames="kernels")
    for t in args.tokens:
        x = jnp.zeros((t, p.config.hidden_size), jnp.bfloat16)
        hlo = step.lower(p, x, kernels=PALLAS).compile().as_text()
        ops = entry_ops(hlo)
        print(f"T={t}: {sum(ops.values())} ENTRY ops: {dict(ops.most_common())}")
        for line in hlo[hlo.index("\nENTRY"):].splitlines()[1:]:
            if re.search(r"\b(fusion|custom-call|sort|scatter|gather|while|copy)\(", line):
                print("   ", line.strip()[:160])


if __name__ == "__main__":
    main()
