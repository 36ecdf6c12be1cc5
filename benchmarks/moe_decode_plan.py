"""The MoE decode plan (pairs sorted by expert, the slots and the Mosaic kernels' work items) by
each way of building it, on random top-k routings: GPU time per call summed over its launches
(CUPTI through torch.profiler: the CUDA-graph floor) and the launches, plus the time per call
inside one jitted scan.

    python benchmarks/moe_decode_plan.py [--tokens 8 16 32 64] [--experts 128 32] [--k 8]

Builders: ``xla`` (XLA's pairwise plan, then XLA's item cut), ``xla-sort`` (XLA's sort plan,
then the cut), ``pairwise`` (one Pallas program of pairwise comparisons, up to 128 pairs;
``make_plan`` takes it up to ``PALLAS_PLAN_MAX_PAIRS``), ``radix`` (one Pallas program that
radix-sorts the pair keys, up to ``RADIX_PLAN_MAX_PAIRS``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import device_busy, rotating, table, time_scan  # noqa: E402
from pallas_kernels.moe_decode.kernel import (  # noqa: E402
    PALLAS_PLAN_MAX_PAIRS,
    RADIX_PLAN_MAX_PAIRS,
    _dense_plan,
    _pallas_plan,
    _pallas_radix_plan,
    _sorted_plan,
)
from pallas_kernels.moe_decode.mosaic import ROWS, work_items  # noqa: E402

PAIRWISE_MAX = max(128, PALLAS_PLAN_MAX_PAIRS)  # timed past make_plan's bound, for comparison


def builders(pairs: int, interpret: bool) -> dict:
    """name -> ``f(ids, num_experts)`` giving (work, token_of_row, row_of_pair, items)."""

    def cut(plan_fn):
        def build(ids, e):
            plan = plan_fn(ids, e)
            return plan.work, plan.token_of_row, plan.row_of_pair, work_items(plan, e)
        return build

    def pallas(plan_fn):
        def build(ids, e):
            plan = plan_fn(ids, e, interpret=interpret, item_rows=ROWS)
            return plan.work, plan.token_of_row, plan.row_of_pair, plan.items
        return build

    out = {"xla": cut(_dense_plan), "xla-sort": cut(_sorted_plan)}
    if pairs <= PAIRWISE_MAX:
        out["pairwise"] = pallas(_pallas_plan)
    if pairs <= RADIX_PLAN_MAX_PAIRS:
        out["radix"] = pallas(_pallas_radix_plan)
    return out


def routings(t: int, k: int, e: int, n: int = 4, seed: int = 0) -> list[jax.Array]:
    rng = np.random.default_rng(seed)
    return [jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(t)]), jnp.int32)
            for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", nargs="+", type=int, default=[8, 16, 32, 64])
    parser.add_argument("--experts", nargs="+", type=int, default=[128, 32])
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--loops", type=int, default=16)
    parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    args = parser.parse_args()
    rows = []
    for e in args.experts:
        k = min(args.k, e)
        for t in args.tokens:
            ids = routings(t, k, e)
            ref = None
            for name, build in builders(t * k, args.interpret).items():
                fn = jax.jit(build, static_argnums=1)
                out = jax.tree.map(np.asarray, fn(ids[0], e))
                if ref is None:
                    ref = out
                for a, b, field in zip(out, ref, ("work", "token_of_row", "row_of_pair",
                                                  "items"), strict=True):
                    np.testing.assert_array_equal(a, b, err_msg=f"{name}: {field}")
                busy = device_busy(rotating(lambda _, i, fn=fn, e=e: fn(i, e), None, ids))
                scan_us = time_scan(lambda _, i, fn=fn, e=e: fn(i, e), 0, ids,
                                    loops=args.loops) * 1e6
                rows.append(dict(experts=e, tokens=t, pairs=t * k, plan=name, scan_us=scan_us,
                                 busy_us=busy[0] * 1e6 if busy else "",
                                 launches=busy[1] if busy else ""))
                print(rows[-1], flush=True)
    print(table(rows, ["experts", "tokens", "pairs", "plan", "busy_us", "launches", "scan_us"]))


if __name__ == "__main__":
    main()
