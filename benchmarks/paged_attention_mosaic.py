"""FP8 paged decode on the Mosaic GPU kernel (``pallas_kernels/paged_attention/mosaic.py``)
against the Triton decode kernel on the same FP8 cache and on a BF16 cache of the same shape,
with the HBM copy bandwidth measured in the same run (H200).

Each step is timed as ``benchmarks/paged_attention.py`` times its decode steps (``time_scan``:
a few query sets inside one jitted scan, the cache as constants) plus the GPU busy time
(CUPTI). ``fp8_vs_bf16`` is the issue's measure: the BF16 kernel's time over the FP8 Mosaic
kernel's (tokens/s ratio). ``frac`` = KV bytes (with the scales) / time / HBM bandwidth.
First each case's Mosaic output is compared with the XLA reference on this GPU (``err``).

    python benchmarks/paged_attention_mosaic.py [--cases B,CTX,HQ,HK[,Q] ...] [--sweep]
        [--out f.md]

``Q`` (default 1): query tokens a sequence (MTP verify steps); the Mosaic kernel's query rows
a program are ``Q * HQ / HK`` (at most 64).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import device_busy, hbm_copy_bandwidth, table, time_scan  # noqa: E402
from benchmarks.paged_attention import (  # noqa: E402
    make_cache,
    ours_step,
    queries,
    ref_step,
    rel_err,
    short_err,
)
from pallas_kernels.paged_attention import kv_bytes_per_token  # noqa: E402
from pallas_kernels.paged_attention.mosaic import paged_decode_mosaic  # noqa: E402

D = 128
CASES = [(32, 4096, 32, 4), (32, 16384, 32, 4), (8, 16384, 32, 4), (1, 32768, 32, 4),
         (32, 16384, 64, 8)]


def mosaic_step(**kw):
    def step(c, q):
        return paged_decode_mosaic(q, c["k_pages"], c["v_pages"], c["block_tables"],
                                   c["seq_lens"], k_scale=c["k_scale"], v_scale=c["v_scale"],
                                   scale=D**-0.5, **kw)

    return step


def timed(step, cache, xs):
    t = time_scan(step, cache, xs)
    busy = device_busy(jax.jit(step), cache, xs[0])
    return t, busy[0] if busy else float("nan")


def bench(cases, hbm: float) -> list[dict]:
    rows = []
    for b, ctx, hq, hk, *q_len in cases:
        q_len = q_len[0] if q_len else 1
        row = dict(B=b, ctx=ctx, heads=f"{hq}/{hk}", Q=q_len)
        xs = queries(jax.random.key(1), b, hq, D, q_len=q_len)
        for dtype, name, step in (("bf16", "bf16_triton", ours_step("bf16", D)),
                                  ("fp8", "fp8_triton", ours_step("fp8", D)),
                                  ("fp8", "fp8_mosaic", mosaic_step())):
            cache = make_cache(jax.random.key(0), b, ctx, hk, D, dtype)
            nbytes = b * ctx * kv_bytes_per_token(dtype, hk, D)
            try:
                if name == "fp8_mosaic":
                    want = jax.jit(ref_step("fp8", D))(cache, xs[0])
                    row["err"] = rel_err(jax.jit(step)(cache, xs[0]), want)
                t, busy = timed(step, cache, xs)
                row[f"{name}_us"] = t * 1e6
                row[f"{name}_busy_us"] = busy * 1e6
                row[f"{name}_frac"] = nbytes / t / hbm
            except Exception as err:  # report in the table
                row[f"{name}_us"] = short_err(err)
            del cache
        if isinstance(row.get("fp8_mosaic_us"), float):
            row["fp8_vs_bf16"] = row["bf16_triton_us"] / row["fp8_mosaic_us"]
            row["vs_fp8_triton"] = row["fp8_triton_us"] / row["fp8_mosaic_us"]
        rows.append(row)
        print(table([row], list(row)), flush=True)
    return rows


SWEEP = [((32, 16384, 32, 4), (3, 4, 6), (None, 1, 2, 4, 6)),
         ((1, 32768, 32, 4), (4, 6), (None, 16, 33))]


def sweep(case, stage_counts, split_counts, hbm: float) -> list[dict]:
    """Mosaic variants (stages, splits; None: ``choose_splits``) on one case."""
    b, ctx, hq, hk, *q_len = case
    q_len = q_len[0] if q_len else 1
    xs = queries(jax.random.key(1), b, hq, D, q_len=q_len)
    cache = make_cache(jax.random.key(0), b, ctx, hk, D, "fp8")
    nbytes = b * ctx * kv_bytes_per_token("fp8", hk, D)
    rows = []
    for stages in stage_counts:
        for splits in split_counts:
            row = dict(B=b, ctx=ctx, heads=f"{hq}/{hk}", Q=q_len, stages=stages,
                       splits="auto" if splits is None else splits)
            try:
                t, busy = timed(mosaic_step(num_stages=stages, num_splits=splits), cache, xs)
                row.update(us=t * 1e6, busy_us=busy * 1e6, frac=nbytes / t / hbm)
            except Exception as err:  # report in the table
                row["us"] = short_err(err)
            rows.append(row)
            print(table([row], list(row)), flush=True)
    return rows


def case_arg(text: str) -> tuple[int, ...]:
    """``B,CTX,HQ,HK[,Q]`` -> a tuple of ints."""
    return tuple(int(v) for v in text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", type=case_arg, help="B,CTX,HQ,HK[,Q] each")
    parser.add_argument("--sweep", action="store_true",
                        help="also time Mosaic stages x splits (SWEEP: B 32 16k, B 1 32k)")
    parser.add_argument("--sweep-cases", nargs="+", type=case_arg, metavar="B,CTX,HQ,HK[,Q]",
                        help="--sweep these cases instead (--sweep-stages x --sweep-splits)")
    parser.add_argument("--sweep-stages", nargs="+", type=int, default=[3, 4, 6])
    parser.add_argument("--sweep-splits", nargs="+", type=int, default=[1, 2, 4, 6],
                        help="--sweep-cases: splits besides choose_splits' (default 1 2 4 6)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cases = args.cases or CASES
    print(f"{datetime.date.today()} {jax.devices()[0].device_kind}", flush=True)
    hbm = hbm_copy_bandwidth()
    rows = bench(cases, hbm)
    cols = list(dict.fromkeys(c for r in rows for c in r))
    text = f"HBM copy {hbm / 1e12:.2f} TB/s\n\n" + table(rows, cols)
    if args.sweep:
        todo = SWEEP if not args.sweep_cases else [
            (c, args.sweep_stages, (None, *args.sweep_splits)) for c in args.sweep_cases]
        swept = [row for case in todo for row in sweep(*case, hbm)]
        text += "\n\n" + table(swept, list(swept[0]))
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
