"""Timing helpers and the two ceilings (HBM copy bandwidth, dense bf16 matmul rate), measured in
the same run as the benchmark that reports against them."""

from __future__ import annotations

import collections
import contextlib
import shutil
import statistics
import subprocess
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
    """``loop(consts, stacked_xs)``: ``step(consts, x)`` for every x of the stacked inputs,
    inside one jitted ``lax.scan``. Rolled on purpose: on the H200 the straight-line program
    measured slower per step for short steps (Qwen3 1-token MoE decode 61 us vs 50 us; B=1 32k
    paged decode 62 vs 39 us): XLA launches it thunk by thunk from the host, which cannot keep
    up (``moe_decode_hlo.py --timeline``: ~24 us idle before each 1-token step). The rolled
    loop pays XLA:GPU's while-loop overhead every step instead (its predicate read back by the
    host, a copy of the step's output: ~5-8 us of GPU idle and two launches at 1 token)."""

    @jax.jit
    def loop(c, xx):
        return jax.lax.scan(lambda carry, x: (carry, step(c, x)), 0, xx)[1]

    return loop


def time_scan(step: Callable, consts, xs, *, repeats: int = 5, loops: int = 8) -> float:
    """Seconds per ``step(consts, x)`` over the inputs ``xs`` (a list of arrays or pytrees),
    all steps inside one jitted program (``scan_program``): the marginal cost of a step, the
    difference of two programs (``xs`` cycled ``loops`` and ``4 * loops`` times; median of
    ``repeats`` calls each) over the steps between them, so that a call's own cost (the host's
    dispatch of the weight pytree and its wait for the result: ~300 us a call for a decode
    layer on the H200, 5 us a step of a 64-step call) drops out; launch gaps and the loop's
    overhead stay in. ``device_busy`` gives the kernels' time alone."""
    prog = scan_program(step)

    def call_seconds(n):
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *(list(xs) * n))
        return time_jax(prog, consts, stacked, iters=1, repeats=repeats, warmup=1)

    return (call_seconds(4 * loops) - call_seconds(loops)) / (3 * loops * len(xs))


def rotating(fn: Callable, consts, xs) -> Callable:
    """A zero-argument call of ``fn(consts, x)`` that takes the next of ``xs`` each time (so
    consecutive calls do not find their inputs' working set in L2)."""
    state = {"i": 0}

    def call():
        state["i"] += 1
        return fn(consts, xs[state["i"] % len(xs)])

    return call


def device_busy(fn: Callable, *args, calls: int = 20) -> tuple[float, float] | None:
    """(GPU seconds per call summed over the kernels and copies it launched, their count per
    call), recorded by CUPTI through ``torch.profiler`` (process-wide, so JAX's kernels are
    seen); None without torch or when no device activity was recorded. The floor a step
    approaches when its launches are captured as a CUDA graph: no host gaps, no loop overhead.
    """
    kernels = device_kernels(fn, *args, calls=calls)
    if not kernels:
        return None
    return sum(s for _, s, _ in kernels), sum(n for _, _, n in kernels)


def device_kernels(fn: Callable, *args, calls: int = 20,
                   by_order: bool = False) -> list[tuple[str, float, float]] | None:
    """``(name, GPU seconds per call, launches per call)`` of each kernel or copy that ``fn``
    launches, longest first (``device_timeline``, summed by name); None without torch.
    ``by_order``: a kernel launched n > 1 times a call (the two Mosaic GPU decode launches
    share a name) gets a row per launch, ``#i name`` for its i-th launch of the call in start
    order."""
    events = device_timeline(fn, *args, calls=calls)
    if events is None:
        return None
    launches = collections.Counter(name for name, _, _ in events)
    seen, totals = collections.Counter(), {}
    for name, start, end in events:
        key = name
        if by_order:
            n, rest = divmod(launches[name], calls)  # launches a call
            if n > 1 and not rest:
                key = f"#{seen[name] % n} {name}"
            seen[name] += 1
        total, count = totals.get(key, (0.0, 0))
        totals[key] = (total + end - start, count + 1)
    rows = [(k, t * 1e-6 / calls, c / calls) for k, (t, c) in totals.items()]
    return sorted(rows, key=lambda r: -r[1])


def device_timeline(fn: Callable, *args, calls: int = 3) -> list[tuple[str, float, float]] | None:
    """Every kernel and copy ``calls`` calls of ``fn(*args)`` put on the GPU, as ``(name, start
    us, end us)`` in start order, recorded by CUPTI through ``torch.profiler`` (process-wide,
    so JAX's kernels are seen; after one call outside the record); None without torch."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    torch.cuda.init()
    jax.block_until_ready(fn(*args))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
    events = [(ev.name, ev.time_range.start, ev.time_range.end) for ev in prof.events()
              if ev.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(events, key=lambda ev: ev[1])


def time_torch(fn: Callable) -> float:
    """Median seconds per call, timed with CUDA events (triton.testing.do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3


def parse_clock_samples(text: str) -> dict:
    """``nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits`` lines ->
    ``{sm_mhz_min, sm_mhz_median, power_w_max}`` (empty where no line parses)."""
    clocks, power = [], []
    for line in text.splitlines():
        parts = [v.strip() for v in line.split(",")]
        try:
            clocks.append(float(parts[0]))
            power.append(float(parts[1]))
        except (ValueError, IndexError):
            continue
    if not clocks:
        return {}
    return dict(sm_mhz_min=min(clocks), sm_mhz_median=statistics.median(clocks),
                power_w_max=max(power))


@contextlib.contextmanager
def clock_samples(period_ms: int = 50):
    """Samples the GPU's SM clock and power by ``nvidia-smi`` every ``period_ms`` while the
    block runs; yields a dict filled on exit (``parse_clock_samples``; empty without
    ``nvidia-smi``). A long FP4 step's time moves with the clock: the H200 capped it at
    1890-1965 MHz under its software power cap in some calls (NOTES, session 29)."""
    out: dict = {}
    smi = shutil.which("nvidia-smi")
    if smi is None:
        yield out
        return
    proc = subprocess.Popen([smi, "--query-gpu=clocks.sm,power.draw",
                             "--format=csv,noheader,nounits", f"-lms={period_ms}"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        yield out
    finally:
        proc.terminate()
        text, _ = proc.communicate(timeout=10)
        out.update(parse_clock_samples(text))


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
