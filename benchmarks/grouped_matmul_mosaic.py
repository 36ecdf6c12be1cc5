"""BF16 grouped matmul: our Mosaic GPU kernel (a few tile variants) against our Triton-lowering
kernel and torch._grouped_mm, in one run on one GPU.

    python benchmarks/grouped_matmul_mosaic.py [--quick] [--tokens 512 4096 16384]

Step 1 checks every variant against the plain-jnp reference on the GPU (ragged and empty
groups, N not a multiple of the tile, K = 208 in 16-wide K steps, plain and fused SwiGLU, bf16
and f32 out); step 2 times Qwen3-30B-A3B / DeepSeek-V3 / gpt-oss-120b gate_up (plain and fused
SwiGLU) and down.
Each configuration runs in its own try/except: a failure prints its exception and the run goes
on. Columns: microseconds and TFLOP/s of each implementation, and each Mosaic variant's speed
over torch and over our Triton kernel.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import table, time_jax, time_torch  # noqa: E402
from benchmarks.grouped_matmul import (  # noqa: E402
    SHAPES,
    make_weight,
    rel_err,
    routing_group_sizes,
    torch_grouped_mm,
)
from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference  # noqa: E402
from pallas_kernels.grouped_matmul.mosaic import (  # noqa: E402
    MosaicTileConfig,
    grouped_matmul_mosaic,
)

VARIANTS = {  # name: tile (None: the heuristic)
    "auto": None,  # 128 x 256 x 64, 4 stages for bf16 out
    "m128n128s5": MosaicTileConfig(block_m=128, block_n=128, num_stages=5),
    "m64n256s5": MosaicTileConfig(block_m=64, block_n=256, num_stages=5),
}


def _fused_tile(tile: MosaicTileConfig | None) -> MosaicTileConfig | None:
    """The variant's tile for a fused gate_up (block_n counts output columns: half of it)."""
    if tile is None:
        return None
    return dataclasses.replace(tile, block_n=max(tile.block_n // 2, 128))


def check_correctness(variants: dict) -> list[dict]:
    rows = []
    key = jax.random.key(0)
    cases = [  # (M, N, K, G, group sizes)
        (1000, 512, 512, 8, "random"),
        (777, 272, 208, 16, "skewed+empty"),  # K % 64 = 16
    ]
    for m, n, k, g, pattern in cases:
        kx, kw, kg = jax.random.split(jax.random.fold_in(key, m), 3)
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        w = (jax.random.normal(kw, (g, n, k), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
        if pattern == "random":
            gs = routing_group_sizes(kg, m // 2, g, 2)
        else:
            gs = jnp.zeros((g,), jnp.int32).at[3].set(m - 140).at[4].set(1).at[g - 1].set(97)
        for name, tile in variants.items():
            for activation, out_dtype in ((None, jnp.bfloat16), (None, jnp.float32),
                                          ("silu", jnp.bfloat16)):
                if out_dtype == jnp.float32 and tile is not None:
                    continue  # explicit variants are sized for bf16 out; "auto" covers f32
                row = dict(M=m, N=n, K=k, G=g, groups=pattern, variant=name,
                           activation=activation or "-", out=jnp.dtype(out_dtype).name)
                try:
                    t = tile if activation is None else _fused_tile(tile)
                    if t is not None and k % t.block_k:
                        t = dataclasses.replace(t, block_k=16)
                    out = grouped_matmul_mosaic(x, w, gs, activation=activation,
                                                out_dtype=out_dtype, tile=t)
                    ref = grouped_matmul_reference(x, w, gs, fmt="bf16", activation=activation)
                    err = rel_err(out.astype(jnp.float32), ref)
                    ok = bool(np.isfinite(np.asarray(out.astype(jnp.float32))).all()) and (
                        err < 1e-2)
                    row.update(rel_err=err, ok="yes" if ok else "NO")
                except Exception as e:  # compile errors expected on a first GPU try
                    traceback.print_exc()
                    row.update(rel_err="", ok=f"ERROR {type(e).__name__}: {str(e)[:80]}")
                print(table([row], list(row)), flush=True)
                rows.append(row)
    return rows


def bench(variants: dict, shapes: list[str], token_counts: list[int]) -> list[dict]:
    rows = []
    key = jax.random.key(1)
    for shape in shapes:
        h, inter, e, topk = SHAPES[shape]
        for op, n, kdim in (("gate_up", 2 * inter, h), ("gate_up+silu", 2 * inter, h),
                            ("down", h, inter)):
            activation = "silu" if op.endswith("silu") else None
            for tokens in token_counts:
                t0 = time.perf_counter()
                m = tokens * topk
                gs = routing_group_sizes(jax.random.fold_in(key, tokens), tokens, e, topk)
                x = jax.random.normal(jax.random.fold_in(key, 7), (m, kdim), jnp.bfloat16)
                w = make_weight(key, e, n, kdim, "bf16").data
                flops = 2.0 * m * n * kdim
                row = dict(shape=shape, op=op, tokens=tokens)
                times = {}
                if activation is None:
                    try:
                        f = torch_grouped_mm(x, w, gs)
                        if f is not None:
                            times["torch"] = time_torch(f)
                        del f
                    except Exception as err:
                        row["torch_us"] = f"ERROR {type(err).__name__}"
                impls = {"triton": functools.partial(
                    grouped_matmul, fmt="bf16", activation=activation)}
                for name, tile in variants.items():
                    impls[name] = functools.partial(
                        grouped_matmul_mosaic, activation=activation,
                        tile=tile if activation is None else _fused_tile(tile))
                for name, fn in impls.items():
                    try:
                        times[name] = time_jax(fn, x, w, gs, iters=10, repeats=3)
                    except Exception as err:
                        row[f"{name}_us"] = f"ERROR {type(err).__name__}: {str(err)[:60]}"
                for name, sec in times.items():
                    row[f"{name}_us"] = sec * 1e6
                    row[f"{name}_tflops"] = flops / sec / 1e12
                for name in variants:
                    if name in times:
                        if "torch" in times:
                            row[f"{name}_vs_torch"] = times["torch"] / times[name]
                        if "triton" in times:
                            row[f"{name}_vs_triton"] = times["triton"] / times[name]
                print(table([row], list(row)), f"({time.perf_counter() - t0:.1f}s)",
                      flush=True)
                rows.append(row)
                del x, w
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="Qwen3-30B-A3B, 4096 tokens only")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[512, 4096, 16384])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        sys.exit("benchmarks/grouped_matmul_mosaic.py needs a GPU")
    variants = {name: VARIANTS[name] for name in args.variants}
    shapes, tokens = (["qwen3-30b-a3b"], [4096]) if args.quick else (args.shapes, args.tokens)
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    if not args.skip_check:
        check = check_correctness(variants)
        print("### Correctness on the GPU (Mosaic kernel vs reference)\n")
        print(table(check, list(check[0])), flush=True)
        bad = [r for r in check if r["ok"] != "yes"]
        print(f"{len(bad)} correctness failures", flush=True)
    rows = bench(variants, shapes, tokens)
    cols = list(dict.fromkeys(c for r in rows for c in r))
    print("\n### Timings (bf16)\n")
    print(table(rows, cols))


if __name__ == "__main__":
    main()
