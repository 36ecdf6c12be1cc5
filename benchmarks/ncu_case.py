"""Run one kernel case a few times, for an outside profiler (Nsight Compute) to catch a launch.

    ncu --clock-control none -k regex:paged_decode --launch-skip 2 --launch-count 1 \\
        python benchmarks/ncu_case.py paged 32 16384 32 4 128 fp8
    ncu --clock-control none --target-processes all -k regex:moe_decode --launch-skip 4 \\
        --launch-count 2 python benchmarks/ncu_case.py moe qwen3-30b-a3b nvfp4 8
    ncu --clock-control none --target-processes all -k regex:mosaic --launch-skip 4 \\
        --launch-count 2 python benchmarks/ncu_case.py moe qwen3-30b-a3b nvfp4 64 \\
        --decode-kernel mosaic

The case is built as in ``paged_attention.py`` / ``moe_decode.py`` (random data, never zeros)
and run ``--calls`` times, each call synchronized, so the kernels of call 3 on are warm.
Nothing is timed here: ncu's report is the output. (One MoE run without
``--target-processes all`` printed no report and no error; with it, the report came.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import atlas_jax as aj  # noqa: E402
from benchmarks import moe_decode as md  # noqa: E402
from benchmarks import paged_attention as pa  # noqa: E402
from pallas_kernels.paged_attention import DecodeConfig  # noqa: E402


def paged_call(b: int, ctx: int, hq: int, hk: int, d: int, dtype: str, config=None):
    key = jax.random.key(0)
    cache = pa.make_cache(key, b, ctx, hk, d, dtype)
    q = pa.queries(key, b, hq, d, n=1)[0]
    fn = jax.jit(pa.ours_step(dtype, d, config))
    return lambda: fn(cache, q)


def parse_config(text: str) -> DecodeConfig:
    """``PPS,SPLITS,WARPS,STAGES[,V_CONVERT[,K_CONVERT]]`` -> DecodeConfig."""
    parts = text.split(",")
    if not 4 <= len(parts) <= 6:
        raise argparse.ArgumentTypeError(f"expected PPS,SPLITS,WARPS,STAGES[,V[,K]], got {text!r}")
    try:
        nums = [int(x) for x in parts[:4]]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    converts = dict(zip(("v_convert", "k_convert"), parts[4:], strict=False))
    try:
        return DecodeConfig(*nums, **converts)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def moe_call(shape: str, fmt: str, tokens: int, decode_kernel: str = "auto"):
    params = md.make_layer(shape, fmt)
    x = md.token_sets(tokens, params.config.hidden_size, 1)[0]
    kernels = md.PALLAS.replace(decode_kernel=decode_kernel)
    fn = jax.jit(lambda p, x: aj.moe_forward(p, x, kernels=kernels))
    return lambda: fn(params, x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=5)
    sub = parser.add_subparsers(dest="kind", required=True)
    p = sub.add_parser("paged", help="paged decode: B CTX HQ HK D KV")
    for name in ("b", "ctx", "hq", "hk", "d"):
        p.add_argument(name, type=int)
    p.add_argument("kv", choices=pa.GRID_KV)
    p.add_argument("--config", type=parse_config, default=None,
                   help="a DecodeConfig instead of the heuristic's: PPS,SPLITS,WARPS,STAGES"
                        "[,V_CONVERT[,K_CONVERT]], e.g. 8,3,4,2,asm")
    m = sub.add_parser("moe", help="moe_forward decode step: SHAPE FORMAT TOKENS")
    m.add_argument("shape", choices=list(md.SHAPES))
    m.add_argument("fmt", choices=list(md.FORMATS))
    m.add_argument("tokens", type=int)
    m.add_argument("--decode-kernel", choices=("auto", "triton", "mosaic"), default="auto",
                   help="KernelConfig.decode_kernel")
    args = parser.parse_args()
    if args.kind == "paged":
        call = paged_call(args.b, args.ctx, args.hq, args.hk, args.d, args.kv, args.config)
    else:
        call = moe_call(args.shape, args.fmt, args.tokens, args.decode_kernel)
    for _ in range(args.calls):
        jax.block_until_ready(call())


if __name__ == "__main__":
    main()
