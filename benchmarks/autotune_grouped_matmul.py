"""Autotune the grouped-matmul tiles on this GPU and store the winners per device in
pallas_kernels/grouped_matmul/tuned.json (read by the kernel before its heuristic).

    python benchmarks/autotune_grouped_matmul.py [--shapes qwen3-30b-a3b] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import time_jax  # noqa: E402
from benchmarks.grouped_matmul import (  # noqa: E402
    FORMATS,
    SHAPES,
    kernel_args,
    make_weight,
    routing_group_sizes,
)
from pallas_kernels.grouped_matmul import TileConfig, device_kind, grouped_matmul  # noqa: E402
from pallas_kernels.grouped_matmul.tuned import TUNED_PATH, store, tuned_key  # noqa: E402

CANDIDATES = [  # (block_m, block_n, block_k, num_warps, num_stages)
    (128, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3),
    (128, 256, 128, 8, 2), (64, 128, 128, 4, 4), (128, 128, 128, 4, 4), (64, 256, 64, 8, 3),
]


def tune_one(x, q, gs, fmt: str, activation: str | None) -> tuple[TileConfig, float, float]:
    """Best candidate and its time, and the heuristic's time, for one problem."""
    kw = kernel_args(q, fmt)
    if activation:
        kw["activation"] = activation
    heuristic = time_jax(jax.jit(functools.partial(grouped_matmul, **kw)), x, q.data, gs,
                         iters=5, repeats=3)
    best, best_t = None, heuristic
    for bm, bn, bk, warps, stages in CANDIDATES:
        try:
            tile = TileConfig(bm, bn, bk, warps, stages)
            fn = jax.jit(functools.partial(grouped_matmul, tile=tile, **kw))
            t = time_jax(fn, x, q.data, gs, iters=5, repeats=3)
        except Exception as err:  # an unsupported or oversized tile: skip it, say which
            print(f"  skip {bm}x{bn}x{bk} w{warps} s{stages}: {type(err).__name__}", flush=True)
            continue
        if t < best_t:
            best, best_t = tile, t
    return best, best_t, heuristic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b"], choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[4096])
    parser.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    parser.add_argument("--out", type=Path, default=TUNED_PATH)
    args = parser.parse_args()
    kind = device_kind()
    if kind is None:
        sys.exit("autotune needs a GPU")
    key = jax.random.key(0)
    winners = {}
    for shape in args.shapes:
        h, inter, e, k = SHAPES[shape]
        for tokens in args.tokens:
            gs = routing_group_sizes(jax.random.fold_in(key, tokens), tokens, e, k)
            m = tokens * k
            for op, (n, kdim, activation) in {
                "gate_up": (2 * inter, h, None), "gate_up_silu": (2 * inter, h, "silu"),
                "down": (h, inter, None),
            }.items():
                x = jax.random.normal(key, (m, kdim), jnp.bfloat16)
                for fmt in args.formats:
                    q = make_weight(key, e, n, kdim, fmt)
                    best, t, t0 = tune_one(x, q, gs, fmt, activation)
                    flops = 2.0 * m * n * kdim
                    print(f"{shape} {op} {tokens} {fmt}: heuristic {flops / t0 / 1e12:.0f} "
                          f"TFLOP/s, best {flops / t / 1e12:.0f} ({best})", flush=True)
                    if best is not None:
                        n_out = n // 2 if activation else n
                        key_ = tuned_key(m, n_out, kdim, e, q.format.value,
                                         fused_gate_up=bool(activation),
                                         act_quant="fp8" if fmt == "fp8_w8a8" else "none")
                        store(kind, {key_: best}, args.out)  # as we go: a cut run keeps these
                        winners[key_] = best
                    del q
    print(f"stored {len(winners)} winners for {kind} in {args.out}")


if __name__ == "__main__":
    main()
