"""Timing helpers and the two ceilings (HBM copy bandwidth, dense bf16 matmul rate), measured in
the same run as the benchmark that reports against them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp


def time_jax(fn: Callable, *args, iters: int = 20, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds per call of an already-jitted ``fn(*args)`` (device-synchronized)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def scan_program(step: Callable) -> Callable:
    """``loop(consts, stacked_xs)``: ``step(consts, x)`` for every x of the stacked inputs, in
    one jitted program with the scan fully unrolled. A rolled ``lax.scan`` is a while loop, and
    XLA:GPU reads a while loop's predicate back to the host every iteration: measured on the
    H200, that put a ~15 us floor under every step (B=1 paged decode of 2 MB of KV: 18.6 us)."""

    @jax.jit
    def loop(c, xx):
        return jax.lax.scan(lambda carry, x: (carry, step(c, x)), 0, xx, unroll=True)[1]

    return loop


def time_scan(step: Callable, consts, xs, *, repeats: int = 5, loops: int = 8) -> float:
    """Median device seconds per ``step(consts, x)`` over the inputs ``xs`` (a list of arrays
    or pytrees, cycled ``loops`` times), all steps back to back in one jitted program
    (``scan_program``): launch gaps between the kernels count, the host's per-call dispatch
    (~30 us for a pytree of weights) does not. That is METHOD.md's "time graph replays" for
    steps of many small launches, and how a decode loop runs them (CUDA graphs, or a model's
    layers in one program)."""
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *(list(xs) * loops))
    steps = len(xs) * loops
    return time_jax(scan_program(step), consts, stacked, iters=1, repeats=repeats,
                    warmup=1) / steps


def time_torch(fn: Callable) -> float:
    """Median seconds per call, timed with CUDA events (triton.testing.do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3


def hbm_copy_bandwidth(gib: float = 4.0) -> float:
    """Bytes/s of a device copy (bytes read + bytes written), as METHOD.md measures it."""
    n = int(gib * 2**30) // 4
    x = jnp.arange(n, dtype=jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)
    seconds = time_jax(copy, x, iters=10)
    return 2 * x.nbytes / seconds


def dense_matmul_rate(n: int = 8192) -> float:
    """FLOP/s of an XLA bf16 n^3 matmul on random data."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.bfloat16))
    return 2 * n**3 / time_jax(mm, a, b, iters=10)


def table(rows: list[dict], columns: list[str]) -> str:
    """A markdown table of ``rows`` (dicts), numbers formatted compactly."""

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
