"""The router (``aj.moe.route``: router matmul, scores, top-k, weights) of each benchmark
shape, XLA's implementation against the Pallas router kernel, on random tokens: GPU time per
call summed over its launches (CUPTI through torch.profiler), the launches, and the time per
call inside one jitted scan; the two routings checked equal (ids exactly, weights to 2e-6).

    python benchmarks/moe_router.py [--shapes qwen3-30b-a3b ...] [--tokens 1 8 64 4096]

The layers carry only what routing reads (router, router bias, selection bias; experts of
width 16).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import atlas_jax as aj  # noqa: E402
from atlas_jax.config import MoEConfig  # noqa: E402
from benchmarks._common import device_busy, rotating, table, time_scan  # noqa: E402
from benchmarks.moe_decode import SHAPES, TINY  # noqa: E402

ROUTERS = ("xla", "pallas")


def router_layer(shape: str) -> aj.moe.MoEParams:
    h, _, e, k, extra = (SHAPES | TINY)[shape]
    extra = {key: v for key, v in extra.items() if not key.startswith("shared")}
    cfg = MoEConfig(hidden_size=h, intermediate_size=16, num_experts=e, top_k=k, **extra)
    return aj.moe.init_params(jax.random.key(0), cfg)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES),
                        choices=list(SHAPES) + list(TINY))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 512, 4096])
    parser.add_argument("--loops", type=int, default=8)
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        params = router_layer(shape)
        for t in args.tokens:
            xs = [jax.random.normal(jax.random.key(i), (t, params.config.hidden_size),
                                    jnp.bfloat16) for i in range(4)]
            ref = None
            for name in ROUTERS:
                kernels = aj.KernelConfig(router=name)
                fn = jax.jit(lambda p, x, kernels=kernels: tuple(aj.moe.route(p, x,
                                                                              kernels=kernels)))
                ids, w = jax.tree.map(np.asarray, fn(params, xs[0]))
                if ref is None:
                    ref = ids, w
                np.testing.assert_array_equal(ids, ref[0], err_msg=f"{shape} {t} {name}")
                np.testing.assert_allclose(w, ref[1], rtol=2e-6, atol=1e-7)
                busy = device_busy(rotating(fn, params, xs))
                scan_us = time_scan(fn, params, xs, loops=args.loops) * 1e6
                rows.append(dict(shape=shape, tokens=t, router=name, scan_us=scan_us,
                                 busy_us=busy[0] * 1e6 if busy else "",
                                 launches=busy[1] if busy else ""))
                print(rows[-1], flush=True)
    print(table(rows, ["shape", "tokens", "router", "busy_us", "launches", "scan_us"]))


if __name__ == "__main__":
    main()
