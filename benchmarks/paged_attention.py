"""Paged-attention benchmark: our Pallas kernels (BF16 / FP8 / NVFP4 KV) with the ceilings
measured in the same run.

* decode: against JAX's `pallas.ops.gpu.paged_attention` (BF16) and the XLA gather reference,
  and the HBM copy bandwidth (decode reads every KV byte once). Every implementation is timed
  the same way, in device time: ``_common.time_scan`` (steps over a few different query sets
  inside one jitted ``lax.scan``, cache / block tables / lengths as its constants), so the
  ~30 us of host dispatch per call does not floor the short cases; ``host_us`` is our kernel
  timed the old way (``time_jax``: one host dispatch per call) for comparison;
* ``--grid``: the full decode grid (B 1/8/32/128 x context 1k/4k/16k/32k x heads 32/4, 64/8 at
  D 128; D 256 / 512 on a subset; page 16) for BF16, FP8 (plus the FP8 kernel with V converted
  by inline PTX, ``DecodeConfig.v_convert="asm"``) and NVFP4 KV; JAX's kernel on the D 128 BF16
  cases. Compiles run ahead in threads (``--jobs``) while earlier cases are timed;
* ``--sweep``: DecodeConfig variants (pages per step, splits, stages, FP8 V/K conversion) against
  the heuristic for the cases the issue's targets name (B=1 at 32k, FP8 at 16k);
* prefill (``--prefill`` runs it alone): first a correctness check of the kernel against the
  reference on this GPU (ragged batch, chunk after a cached prefix, padding, window, softcap,
  sinks; every KV dtype), then prompts of 4k / 16k tokens and a 2k chunk after a 14k prefix
  against the XLA reference (where its [S, L] logits fit), cuDNN's dense causal flash attention
  on contiguous K/V (``jax.nn.dot_product_attention``, fresh BF16 prompts), and the roofline of
  the causal FLOPs at the dense bf16 matmul rate; plus the XLA KV write of the chunk
  (``PagedKVCache.write``: quantize + slot-mapping scatter, donated cache) timed on its own, and
  its share of write + attention. Prefill is timed with ``time_jax`` (long steps).

``--smoke`` runs the decode paths (default cases, grid, sweep) on tiny shapes in interpret mode
on the CPU: a check of this script, not a measurement.

    python benchmarks/paged_attention.py [--quick] [--prefill] [--grid] [--sweep] [--out f.md]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import functools
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    dense_matmul_rate,
    device_busy,
    hbm_copy_bandwidth,
    rotating,
    scan_program,
    table,
    time_jax,
    time_scan,
)
from pallas_kernels.paged_attention import (  # noqa: E402
    DecodeConfig,
    choose_decode_config,
    device_sm_count,
    kv_bytes_per_token,
    paged_decode,
    paged_decode_reference,
    paged_prefill,
    paged_prefill_reference,
)

PAGE = 16
NUM_Q = 4  # different query sets a timed scan cycles through
SMOKE = False  # --smoke: tiny shapes, interpret mode (CPU)
CASES = [  # (batch, context, q heads, kv heads, head_dim, kv dtype)
    (32, 4096, 32, 4, 128, "bf16"),
    (32, 4096, 32, 4, 128, "fp8"),
    (32, 4096, 32, 4, 128, "nvfp4"),
    (32, 16384, 32, 4, 128, "bf16"),
    (32, 16384, 32, 4, 128, "fp8"),
    (1, 32768, 32, 4, 128, "bf16"),
    (8, 4096, 64, 8, 128, "bf16"),
    (128, 1024, 32, 4, 128, "bf16"),
    (8, 8192, 32, 4, 256, "bf16"),
]
QUICK = CASES[:6]
SMOKE_CASES = [(2, 100, 8, 2, 64, "bf16"), (2, 100, 8, 2, 64, "fp8"), (1, 70, 8, 2, 64, "nvfp4")]
SCALE_NAMES = ("k_scale", "v_scale", "k_global_scale", "v_global_scale")


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def make_cache(key, b: int, ctx: int, hk: int, d: int, dtype: str) -> dict:
    """Random pages (never zeros), scattered block tables and every sequence at ``ctx``:
    ``k_pages``, ``v_pages``, the dtype's scale arrays, ``block_tables``, ``seq_lens``."""
    pages_per_seq = -(-ctx // PAGE)
    n = b * pages_per_seq + 7
    kk, kv, kp = jax.random.split(key, 3)
    shape = (n, PAGE, hk, d)
    args = {}
    for name, k in (("k", kk), ("v", kv)):
        k1, k2 = jax.random.split(k)
        match dtype:
            case "bf16":
                args[f"{name}_pages"] = jax.random.normal(k1, shape, jnp.bfloat16)
            case "fp8":
                args[f"{name}_pages"] = jax.random.normal(k1, shape).astype(jnp.float8_e4m3fn)
                args[f"{name}_scale"] = jax.random.uniform(k2, shape[:3], minval=0.5, maxval=1.5)
            case "nvfp4":
                args[f"{name}_pages"] = jax.random.bits(k1, (*shape[:3], d // 2), jnp.uint8)
                args[f"{name}_scale"] = jax.random.uniform(
                    k2, (*shape[:3], d // 16), minval=0.5, maxval=2.0).astype(jnp.float8_e4m3fn)
                args[f"{name}_global_scale"] = jnp.full(shape[:3], 0.1, jnp.float32)
    perm = jax.random.permutation(kp, n)[: b * pages_per_seq].reshape(b, pages_per_seq)
    return dict(args, block_tables=perm.astype(jnp.int32),
                seq_lens=jnp.full((b,), ctx, jnp.int32))


def cache_spec(b: int, ctx: int, hk: int, d: int, dtype: str) -> dict:
    """``make_cache``'s shapes and dtypes (no device memory): what the compiles need."""
    return jax.eval_shape(lambda k: make_cache(k, b, ctx, hk, d, dtype), jax.random.key(0))


def cache_bytes(b: int, ctx: int, hk: int, d: int, dtype: str) -> int:
    return sum(math.prod(a.shape) * a.dtype.itemsize
               for a in jax.tree.leaves(cache_spec(b, ctx, hk, d, dtype)))


def kernel_kwargs(cache: dict, dtype: str, d: int) -> dict:
    """kv_dtype, softmax scale and the scale arrays of ``cache`` as the kernels take them."""
    kw = dict(kv_dtype=dtype, scale=d**-0.5)
    for name in SCALE_NAMES:
        if name in cache:
            kw[name] = cache[name]
    return kw


def queries(key, b: int, hq: int, d: int, n: int = NUM_Q, q_len: int = 1) -> list[jax.Array]:
    """``n`` different random query sets [B, Q, Hq, D] bf16 (one decode step each; Q > 1: an
    MTP verify step's tokens)."""
    return [jax.random.normal(jax.random.fold_in(key, 100 + i), (b, q_len, hq, d),
                              jnp.bfloat16) for i in range(n)]


# ---- the timed steps: step(consts, q), consts = the cache dict (arrays only) ----------------


def ours_step(dtype: str, d: int, config: DecodeConfig | None = None):
    """Our kernel as a ``time_scan`` step; every array comes from the consts (no closures over
    device arrays: those would be baked into the program as constants)."""
    return _decode_step(paged_decode, dtype, d, config=config, interpret=SMOKE)


def ref_step(dtype: str, d: int):
    return _decode_step(paged_decode_reference, dtype, d)


def _decode_step(fn, dtype: str, d: int, **extra):
    def step(c, q):
        return fn(q, c["k_pages"], c["v_pages"], c["block_tables"], c["seq_lens"],
                  **kernel_kwargs(c, dtype, d), **extra)

    return step


JAX_PEER = dict(block_h=16, pages_per_compute_block=8, k_splits=16)


def jax_consts(cache: dict) -> dict:
    """JAX's kernel takes pages [Hk, N, P, D]: transposed once, outside the timing."""
    return dict(k=jnp.transpose(cache["k_pages"], (2, 0, 1, 3)),
                v=jnp.transpose(cache["v_pages"], (2, 0, 1, 3)),
                block_tables=cache["block_tables"], seq_lens=cache["seq_lens"])


def jax_queries(xs, d: int) -> list[jax.Array]:
    """JAX's kernel has no softmax-scale argument: its queries come pre-scaled (outside the
    timing, so it runs no extra op)."""
    return [(x.astype(jnp.float32) * d**-0.5).astype(x.dtype) for x in xs]


def jax_step(c, q):
    from jax.experimental.pallas.ops.gpu import paged_attention as jpa

    return jpa.paged_attention(q[:, 0], c["k"], c["v"], c["block_tables"], c["seq_lens"],
                               interpret=SMOKE, **JAX_PEER)


def rel_err(out, want) -> float:
    out, want = jnp.asarray(out, jnp.float32), jnp.asarray(want, jnp.float32)
    return float(jnp.linalg.norm(out - want) / jnp.linalg.norm(want))


def short_err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:70] if str(e) else ''}"


# ---- time_scan split in two: compile ahead (in threads), then time ---------------------------


def scan_loops(kv_bytes: float, per_call_us: float = 2000.0) -> int:
    """``time_scan``'s ``loops`` for a case: enough steps per timed call for ~2 ms of device
    time (at ~4 TB/s), 1..8 passes over the ``NUM_Q`` query sets (fewer for long cases)."""
    est_us = kv_bytes / 4e12 * 1e6 + 5.0
    return int(min(8, max(1, math.ceil(per_call_us / est_us / NUM_Q))))


@dataclasses.dataclass
class ScanJob:
    """One timed implementation of one case: compiled ahead from shapes only, then timed with
    ``time_scan``'s method (``time_jax`` of one call over the stacked inputs, per step)."""

    step: object
    consts_spec: object
    x_spec: jax.ShapeDtypeStruct
    steps: int  # NUM_Q * loops
    future: concurrent.futures.Future | None = None

    def compile(self):
        stacked = jax.ShapeDtypeStruct((self.steps, *self.x_spec.shape), self.x_spec.dtype)
        return scan_program(self.step).lower(self.consts_spec, stacked).compile()

    def submit(self, pool):
        self.future = pool.submit(self.compile) if pool else None
        return self

    def run(self, consts, xs, repeats: int = 5) -> tuple[float, jax.Array]:
        """(seconds per step, the first step's output)."""
        compiled = self.future.result() if self.future else self.compile()
        stacked = jnp.stack(list(xs) * (self.steps // len(xs)))
        first = compiled(consts, stacked)[0]
        t = time_jax(compiled, consts, stacked, iters=1, repeats=repeats, warmup=1)
        return t / self.steps, first


def _wait_compiled(jobs) -> None:
    """Every compile done before the first timing: compiles in threads during a timing made
    the short cases' numbers jump (H200 grid run, 2026-12-01: B=1 1k FP8 693 us instead of
    ~20 us)."""
    concurrent.futures.wait([j.future for j in jobs if j.future is not None])


# ---- default decode cases --------------------------------------------------------------------


def bench(cases) -> tuple[list[dict], float]:
    hbm = hbm_copy_bandwidth(0.05 if SMOKE else 4.0)
    rows = []
    key = jax.random.key(0)
    for b, ctx, hq, hk, d, dtype in cases:
        cache = make_cache(key, b, ctx, hk, d, dtype)
        xs = queries(key, b, hq, d)
        kv_bytes = b * ctx * kv_bytes_per_token(dtype, hk, d)
        loops = scan_loops(kv_bytes)
        kw = kernel_kwargs(cache, dtype, d)
        pos = (xs[0], cache["k_pages"], cache["v_pages"], cache["block_tables"],
               cache["seq_lens"])
        ours = jax.jit(functools.partial(paged_decode, **kw, interpret=SMOKE))
        try:
            got = ours(*pos)
        except NotImplementedError as e:  # a documented limit of the kernel: say so, go on
            rows.append(dict(B=b, ctx=ctx, heads=f"{hq}/{hk}", D=d, kv=dtype,
                             us=f"NotImplementedError: {str(e)[:90]}"))
            print(table([rows[-1]], list(rows[-1])), flush=True)
            del cache
            continue
        want = jax.jit(functools.partial(paged_decode_reference, **kw))(*pos)
        err = rel_err(got, want)
        del want, got
        t = time_scan(ours_step(dtype, d), cache, xs, loops=loops)
        t_host = time_jax(ours, *pos)
        t_ref = time_scan(ref_step(dtype, d), cache, xs[:2], loops=1, repeats=3)
        row = dict(B=b, ctx=ctx, heads=f"{hq}/{hk}", D=d, kv=dtype, us=t * 1e6,
                   host_us=t_host * 1e6, kv_MB=kv_bytes / 1e6, GBps=kv_bytes / t / 1e9,
                   frac_hbm=kv_bytes / t / hbm, tok_per_s=b / t, xla_ref_us=t_ref * 1e6,
                   rel_err=err)
        busy = device_busy(rotating(jax.jit(ours_step(dtype, d)), cache, xs))
        if busy:
            row.update(busy_us=busy[0] * 1e6, launches=busy[1],
                       busy_frac_hbm=kv_bytes / busy[0] / hbm)
        if dtype == "bf16":
            try:
                t_jax = time_scan(jax_step, jax_consts(cache), jax_queries(xs, d), loops=loops)
                row.update(jax_us=t_jax * 1e6, vs_jax=t_jax / t)
                jax_busy = device_busy(rotating(jax.jit(jax_step), jax_consts(cache),
                                                jax_queries(xs, d)))
                if jax_busy and busy:
                    row["busy_vs_jax"] = jax_busy[0] / busy[0]
            except Exception as e:  # report, do not hide
                row["jax_us"] = short_err(e)
        rows.append(row)
        print(table([row], list(row)), flush=True)
        del cache
    return rows, hbm


# ---- the full decode grid --------------------------------------------------------------------

GRID_B = (1, 8, 32, 128)
GRID_CTX = (1024, 4096, 16384, 32768)
GRID_HEADS = ((32, 4), (64, 8))
GRID_KV = ("bf16", "fp8", "nvfp4")
MEM_LIMIT = 120 * 2**30  # of the H200's ~139 GiB: live caches (+ JAX's transposed copy)


def grid_shapes() -> list[tuple[int, int, int, int, int]]:
    """(B, ctx, Hq, Hk, D): the D 128 grid, then D 256 / 512 at B 1/32, ctx 4k/32k, 32/4."""
    if SMOKE:
        return [(1, 256, 16, 2, 128)]  # 16 pages and D 128: JAX's kernel runs too
    shapes = [(b, ctx, hq, hk, 128) for (hq, hk) in GRID_HEADS for b in GRID_B for ctx in GRID_CTX]
    shapes += [(b, ctx, 32, 4, d) for d in (256, 512) for b in (1, 32) for ctx in (4096, 32768)]
    return shapes


def heuristic(b, ctx, hq, hk, d, dtype) -> DecodeConfig:
    return choose_decode_config(b, hk, hq // hk, 1, -(-ctx // PAGE), PAGE, d, dtype,
                                device_sm_count())


def cfg_str(c: DecodeConfig) -> str:
    extra = "".join(f" {n[0]}:{getattr(c, n)}" for n in ("v_convert", "k_convert")
                    if getattr(c, n) != "cast")
    return f"{c.pages_per_step}p/{c.num_splits}s/{c.num_warps}w/{c.num_stages}st{extra}"


def grid_jobs(shape, pool) -> dict:
    """Every timed implementation of one grid shape, submitted for compilation: keys
    (dtype, variant) with variant "ours", "vasm" (FP8) or "jax" (BF16, D 128)."""
    b, ctx, hq, hk, d = shape
    kv_bytes = b * ctx * kv_bytes_per_token("bf16", hk, d)
    steps = NUM_Q * scan_loops(kv_bytes / 2)  # same step count for every dtype of the shape
    x_spec = jax.ShapeDtypeStruct((b, 1, hq, d), jnp.bfloat16)
    jobs = {}
    for dtype in GRID_KV:
        spec = cache_spec(b, ctx, hk, d, dtype)
        cfg = heuristic(*shape, dtype)
        jobs[dtype, "ours"] = ScanJob(ours_step(dtype, d, cfg), spec, x_spec, steps)
        if dtype == "fp8":
            vasm = dataclasses.replace(cfg, v_convert="asm")
            jobs[dtype, "vasm"] = ScanJob(ours_step(dtype, d, vasm), spec, x_spec, steps)
        if dtype == "bf16" and d == 128:
            jspec = jax.eval_shape(jax_consts, spec)
            jobs[dtype, "jax"] = ScanJob(jax_step, jspec, x_spec, steps)
    if pool is not None:
        for job in jobs.values():
            job.submit(pool)
    return jobs


def grid(jobs_in_flight: int) -> tuple[list[dict], float]:
    hbm = hbm_copy_bandwidth(0.05 if SMOKE else 4.0)
    shapes = grid_shapes()
    pool = (concurrent.futures.ThreadPoolExecutor(jobs_in_flight) if jobs_in_flight > 1
            else None)
    all_jobs = [grid_jobs(shape, pool) for shape in shapes]  # compiles start in order
    _wait_compiled(j for jobs in all_jobs for j in jobs.values())
    rows = []
    key = jax.random.key(0)
    start = time.perf_counter()
    for shape, jobs in zip(shapes, all_jobs, strict=True):
        b, ctx, hq, hk, d = shape
        xs = queries(key, b, hq, d)
        t_bf16 = None
        for dtype in GRID_KV:
            kv_bytes = b * ctx * kv_bytes_per_token(dtype, hk, d)
            row = dict(B=b, ctx=ctx, heads=f"{hq}/{hk}", D=d, kv=dtype, kv_MB=kv_bytes / 1e6,
                       config=cfg_str(heuristic(*shape, dtype)))
            rows.append(row)
            need = cache_bytes(b, ctx, hk, d, dtype) * (2 if (dtype, "jax") in jobs else 1)
            if need > MEM_LIMIT:
                row["us"] = f"skipped: ~{need / 2**30:.0f} GiB of cache does not fit"
                for k in [k for k in jobs if k[0] == dtype]:
                    if jobs[k].future:
                        jobs[k].future.cancel()
                continue
            try:
                cache = make_cache(jax.random.fold_in(key, hash(shape) % 1000), b, ctx, hk, d,
                                   dtype)
                t, out = jobs[dtype, "ours"].run(cache, xs)
            except Exception as e:  # report, do not hide
                row["us"] = short_err(e)
                continue
            row.update(us=t * 1e6, GBps=kv_bytes / t / 1e9, frac_hbm=kv_bytes / t / hbm)
            if dtype == "bf16":
                t_bf16 = t
            elif t_bf16 is not None:
                row["vs_bf16"] = t_bf16 / t  # tokens/s ratio
            if (dtype, "vasm") in jobs:
                try:
                    t_a, out_a = jobs[dtype, "vasm"].run(cache, xs)
                    row.update(vasm_us=t_a * 1e6, vasm_frac_hbm=kv_bytes / t_a / hbm,
                               vasm_speedup=t / t_a, vasm_err=rel_err(out_a, out))
                    if t_bf16 is not None:
                        row["vasm_vs_bf16"] = t_bf16 / t_a
                except Exception as e:
                    row["vasm_us"] = short_err(e)
            if (dtype, "jax") in jobs:
                try:
                    t_j, out_j = jobs[dtype, "jax"].run(jax_consts(cache), jax_queries(xs, d))
                    row.update(jax_us=t_j * 1e6, vs_jax=t_j / t,
                               jax_err=rel_err(out_j.reshape(out.shape), out))
                except Exception as e:
                    row["jax_us"] = short_err(e)
            elif dtype == "bf16":
                row["jax_us"] = "not run (D != 128)"
            del cache
            print(table([row], list(row)), f"[{time.perf_counter() - start:.0f} s]", flush=True)
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)
    return rows, hbm


GRID_COLS = ["B", "ctx", "heads", "D", "kv", "config", "us", "kv_MB", "GBps", "frac_hbm",
             "vs_bf16", "jax_us", "vs_jax", "vasm_us", "vasm_frac_hbm", "vasm_speedup",
             "vasm_vs_bf16", "vasm_err"]


# ---- decode config sweep ---------------------------------------------------------------------


def _sweep_variants():
    """case -> DecodeConfig variants (None: the heuristic's choice)."""
    if SMOKE:
        return {(2, 100, 8, 2, 64, "fp8"): [None, DecodeConfig(2, 2), DecodeConfig(
            2, 2, v_convert="asm"), DecodeConfig(4, 1, v_convert="asm", k_convert="asm")]}
    # Nsight Compute (2026-12-01 session 4): at B32 16k the FP8 kernel held 255 registers a
    # thread, so 2 programs fit an SM (BF16: 156, 3 per SM), and its 384 programs (3 splits)
    # ran in 1.45 waves; the heuristic now fits the splits to whole waves (RESIDENT_PROGRAMS).
    # Session 5's variants: configurations that may hold fewer registers or less shared memory
    # (V converted by PTX before its layout change, 4 pages a step, no software pipelining),
    # at the 3-per-SM grid (3 splits at B32, 12 at B8) and at the heuristic's 2-per-SM one.
    def fp8_variants(two, three):
        return [DecodeConfig(pps, s, 4, st, v_convert=v)
                for pps, s, st, v in ((8, three, 2, "asm"), (8, three, 1, "asm"),
                                      (8, three, 1, "cast"), (8, two, 1, "cast"),
                                      (4, three, 2, "cast"), (4, three, 2, "asm"),
                                      (4, three, 3, "asm"))]

    return {
        (32, 16384, 32, 4, 128, "fp8"): [None, *fp8_variants(2, 3)],
        (32, 4096, 32, 4, 128, "fp8"): [None, *fp8_variants(2, 3)],
        (8, 16384, 32, 4, 128, "fp8"): [None, *fp8_variants(8, 12)],
    }


def sweep(jobs_in_flight: int) -> list[dict]:
    """Time DecodeConfig variants against the heuristic's choice (each checked against the
    reference) for the cases the targets of issue 8 name and miss: B=1 at 32k, FP8 at 16k.
    "vasm" / "kvasm": the heuristic's config with V (V and K) converted by inline PTX."""
    hbm = hbm_copy_bandwidth(0.05 if SMOKE else 4.0)
    pool = (concurrent.futures.ThreadPoolExecutor(jobs_in_flight) if jobs_in_flight > 1
            else None)
    cases = []
    for (b, ctx, hq, hk, d, dtype), variants in _sweep_variants().items():
        base = heuristic(b, ctx, hq, hk, d, dtype)
        named = []
        for v in variants:
            match v:
                case None:
                    named.append((f"heuristic {cfg_str(base)}", base))
                case "vasm":
                    named.append(("heuristic + v asm", dataclasses.replace(base, v_convert="asm")))
                case "kvasm":
                    c = dataclasses.replace(base, v_convert="asm", k_convert="asm")
                    named.append(("heuristic + k,v asm", c))
                case _:
                    named.append((cfg_str(v), v))
        kv_bytes = b * ctx * kv_bytes_per_token(dtype, hk, d)
        steps = NUM_Q * scan_loops(kv_bytes)
        spec = cache_spec(b, ctx, hk, d, dtype)
        x_spec = jax.ShapeDtypeStruct((b, 1, hq, d), jnp.bfloat16)
        jobs = [(name, ScanJob(ours_step(dtype, d, c), spec, x_spec, steps).submit(pool))
                for name, c in named]
        cases.append(((b, ctx, hq, hk, d, dtype), kv_bytes, jobs))
    _wait_compiled(j for _, _, jobs in cases for _, j in jobs)
    rows = []
    key = jax.random.key(0)
    for (b, ctx, hq, hk, d, dtype), kv_bytes, jobs in cases:
        cache = make_cache(key, b, ctx, hk, d, dtype)
        xs = queries(key, b, hq, d)
        want = jax.jit(ref_step(dtype, d))(cache, xs[0])
        for name, job in jobs:
            row = dict(B=b, ctx=ctx, kv=dtype, config=name)
            try:
                t, out = job.run(cache, xs)
                row.update(us=t * 1e6, frac_hbm=kv_bytes / t / hbm, rel_err=rel_err(out, want))
            except Exception as e:  # report, do not hide
                row["us"] = short_err(e)
            rows.append(row)
            print(table([row], list(row)), flush=True)
        del cache, want
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)
    return rows


# ---- prefill ---------------------------------------------------------------------------------

PREFILL_CASES = [  # (batch, cached prefix, chunk, q heads, kv heads, head_dim, kv dtype)
    (1, 0, 4096, 32, 4, 128, "bf16"),
    (1, 0, 4096, 32, 4, 128, "fp8"),
    (1, 0, 4096, 32, 4, 128, "nvfp4"),
    (1, 0, 16384, 32, 4, 128, "bf16"),
    (1, 0, 16384, 32, 4, 128, "fp8"),
    (1, 14336, 2048, 32, 4, 128, "bf16"),
    (1, 14336, 2048, 32, 4, 128, "fp8"),
]
QUICK_PREFILL = [PREFILL_CASES[i] for i in (0, 1, 5)]
REF_MAX_LOGITS = 2**31  # the XLA reference's [B, Hq, S, L] f32 logits, ~3 such arrays live
CHECK_TOL = {"bf16": 1e-2, "fp8": 3e-3, "nvfp4": 3e-3}  # as tests/test_paged_attention_kernel


def chunk_q_pos(b: int, prefix: int, chunk: int, lengths=None) -> jax.Array:
    """[B, chunk] positions ``prefix + s``; ``-1`` past ``lengths[b]`` (padding)."""
    s = np.arange(chunk)[None, :]
    n = np.full((b, 1), chunk) if lengths is None else np.asarray(lengths)[:, None]
    return jnp.asarray(np.where(s < n, prefix + s, -1), jnp.int32)


def prefill_check() -> list[dict]:
    """The kernel against the reference on this GPU: B=3 (chunks of 700, 1 and 300 tokens
    after a cached prefix of 1000, the 1 and 300 ragged: padding), 32/4 heads, D 128; plain,
    and with window 600 + softcap 30 + sinks."""
    key = jax.random.key(7)
    rows = []
    for dtype in ("bf16", "fp8", "nvfp4"):
        cache = make_cache(key, 3, 1700, 4, 128, dtype)
        q = jax.random.normal(jax.random.fold_in(key, 2), (3, 700, 32, 128), jnp.bfloat16)
        q_pos = chunk_q_pos(3, 1000, 700, lengths=[700, 1, 300])
        sinks = jax.random.uniform(jax.random.fold_in(key, 3), (32,), minval=-1.0, maxval=3.0)
        for opts in ({}, dict(sliding_window=600, logit_softcap=30.0, sinks=sinks)):
            kw = dict(kernel_kwargs(cache, dtype, 128), **opts)
            pos = (q, cache["k_pages"], cache["v_pages"], cache["block_tables"], q_pos)
            out = paged_prefill(*pos, **kw, out_dtype=jnp.float32)
            ref = paged_prefill_reference(*pos, **kw)
            err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            pad_zero = bool(jnp.all(jnp.where((q_pos < 0)[..., None, None], out, 0.0) == 0))
            ok = bool(jnp.all(jnp.isfinite(out))) and err <= CHECK_TOL[dtype] and pad_zero
            rows.append(dict(kv=dtype, opts="window+softcap+sinks" if opts else "plain",
                             rel_err=err, padding_zero=pad_zero, ok="PASS" if ok else "FAIL"))
            print(table([rows[-1]], list(rows[-1])), flush=True)
    return rows


def causal_pairs(prefix: int, chunk: int) -> int:
    """(query, key) pairs a chunk after a prefix attends: chunk * prefix + chunk (chunk+1) / 2."""
    return chunk * prefix + chunk * (chunk + 1) // 2


def kv_write_timer(cache: dict, dtype: str, b: int, prefix: int, chunk: int, hk: int, d: int):
    """Seconds per XLA KV write of the chunk (f32 K/V in, quantized + scattered into the
    cache's pages through the slot mapping), the cache donated as in a real step."""
    from atlas_jax.attention.kv_cache import KVPages, PagedKVCache
    from atlas_jax.config import KVDtype as AjKVDtype

    aj = AjKVDtype(dtype)
    pages = lambda w: KVPages(cache[f"{w}_pages"], cache.get(f"{w}_scale"),  # noqa: E731
                              cache.get(f"{w}_global_scale"), aj)
    kv = PagedKVCache(pages("k"), pages("v"), None, None, aj, 0)
    kv = jax.tree.map(jnp.copy, kv)  # its own buffers: the benchmark's cache stays valid
    slots = kv.slot_mapping(cache["block_tables"], chunk_q_pos(b, prefix, chunk)).reshape(-1)
    # K and V made apart: slicing one array per call (eager indexing) cost ~0.7 ms of host
    # time per call and swamped the ~60 us write in the first measurement
    k_new, v_new = (jax.random.normal(jax.random.key(5 + i), (b * chunk, hk, d), jnp.float32)
                    for i in range(2))
    write = jax.jit(lambda c, s, k, v: c.write(s, k, v), donate_argnums=0)
    for _ in range(2):
        kv = write(kv, slots, k_new, v_new)
    jax.block_until_ready(kv)
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(10):
            kv = write(kv, slots, k_new, v_new)
        jax.block_until_ready(kv)
        samples.append((time.perf_counter() - start) / 10)
    return statistics.median(samples)


def cudnn_attention(q, b: int, ctx: int, hq: int, hk: int, d: int):
    """Dense causal flash attention (cuDNN) over contiguous bf16 K/V of the same shapes."""
    kk, kv = jax.random.split(jax.random.key(11))
    k = jax.random.normal(kk, (b, ctx, hk, d), jnp.bfloat16)
    v = jax.random.normal(kv, (b, ctx, hk, d), jnp.bfloat16)
    fn = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                   implementation="cudnn"))
    return lambda: fn(q, k, v)


def bench_prefill(cases, rate: float) -> list[dict]:
    rows = []
    key = jax.random.key(0)
    for b, prefix, chunk, hq, hk, d, dtype in cases:
        ctx = prefix + chunk
        cache = make_cache(key, b, ctx, hk, d, dtype)
        q = jax.random.normal(jax.random.fold_in(key, 1), (b, chunk, hq, d), jnp.bfloat16)
        pos = (q, cache["k_pages"], cache["v_pages"], cache["block_tables"],
               chunk_q_pos(b, prefix, chunk))
        kw = kernel_kwargs(cache, dtype, d)
        ours = jax.jit(functools.partial(paged_prefill, **kw))
        t = time_jax(ours, *pos, iters=10)
        flops = 4 * d * hq * b * causal_pairs(prefix, chunk)
        row = dict(B=b, prefix=prefix, chunk=chunk, heads=f"{hq}/{hk}", D=d, kv=dtype,
                   us=t * 1e6, TFLOPs=flops / t / 1e12, roofline_us=flops / rate * 1e6,
                   frac_roof=flops / rate / t)
        if b * hq * chunk * cache["block_tables"].shape[1] * PAGE <= REF_MAX_LOGITS:
            ref = jax.jit(functools.partial(paged_prefill_reference, **kw))
            want = ref(*pos)
            row["rel_err"] = float(jnp.linalg.norm(ours(*pos).astype(jnp.float32) - want)
                                   / jnp.linalg.norm(want))
            del want
            t_ref = time_jax(ref, *pos, iters=3, repeats=3)
            row.update(xla_ref_us=t_ref * 1e6, vs_xla=t_ref / t)
        else:
            row["xla_ref_us"] = "skipped: logits too large"
        if dtype == "bf16" and prefix == 0:
            try:
                t_peer = time_jax(cudnn_attention(q, b, ctx, hq, hk, d), iters=10)
                row.update(cudnn_us=t_peer * 1e6, vs_cudnn=t_peer / t)
            except Exception as e:  # report, do not hide
                row["cudnn_us"] = f"{type(e).__name__}: {str(e)[:50]}"
        t_w = kv_write_timer(cache, dtype, b, prefix, chunk, hk, d)
        row.update(kv_write_us=t_w * 1e6, write_share=t_w / (t_w + t))
        rows.append(row)
        print(table([row], list(row)), flush=True)
        del cache
    return rows


def _emit(text: str, out: Path | None) -> None:
    print(text)
    if out:
        out.write_text(text)


def _parse_case(text: str, parser) -> tuple:
    try:
        b, ctx, hq, hk, d, kv = text.split(",")
        case = (int(b), int(ctx), int(hq), int(hk), int(d), kv)
    except ValueError:
        parser.error(f"--case {text!r}: want B,CTX,HQ,HK,D,KV (e.g. 1,32768,32,4,128,bf16)")
    if kv not in GRID_KV or case[2] % case[3]:
        parser.error(f"--case {text!r}: KV one of {GRID_KV}, HQ a multiple of HK")
    return case


def main() -> None:
    global SMOKE
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--prefill", action="store_true", help="only the prefill section")
    parser.add_argument("--decode", action="store_true", help="only the decode section")
    parser.add_argument("--grid", action="store_true",
                        help="only: the full decode grid (B x context x heads x D x KV dtype)")
    parser.add_argument("--sweep", action="store_true",
                        help="only: time decode config variants (pages per step, splits, stages, "
                             "FP8 V/K conversion)")
    parser.add_argument("--jobs", type=int, default=8,
                        help="--grid / --sweep: compiles in flight (threads; 1: compile inline)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny decode cases, grid and sweep in interpret mode (CPU check of "
                             "this script, not a measurement)")
    parser.add_argument("--case", action="append", metavar="B,CTX,HQ,HK,D,KV",
                        help="--decode: time this case instead of the default list (repeatable), "
                             "e.g. 1,32768,32,4,128,bf16")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    SMOKE = args.smoke
    cases = [_parse_case(c, parser) for c in args.case] if args.case else None
    if jax.default_backend() != "gpu" and not SMOKE:
        sys.exit("benchmarks/paged_attention.py needs a GPU (or --smoke)")
    device = f"{datetime.date.today()}, {jax.devices()[0].device_kind}, jax {jax.__version__}"
    method = (f"Device time per step: `time_scan` ({NUM_Q} query sets cycled inside one jitted "
              "lax.scan; no host dispatch)")
    if SMOKE:
        rows, _ = bench(SMOKE_CASES)
        grid_rows, _ = grid(args.jobs)
        sweep_rows = sweep(args.jobs)
        _emit("\n\n".join(table(r, list(r[0])) for r in (rows, grid_rows, sweep_rows)),
              args.out)
        return
    if args.sweep:
        rows = sweep(args.jobs)
        _emit(f"## paged_attention decode config sweep ({device}, page {PAGE})\n\n{method}\n\n"
              f"{table(rows, list(rows[0]))}\n", args.out)
        return
    if args.grid:
        start = time.perf_counter()
        rows, hbm = grid(args.jobs)
        _emit(f"## paged_attention decode grid ({device}, page {PAGE})\n\n"
              f"HBM copy {hbm / 1e12:.2f} TB/s (measured in this run). {method}. Config: the "
              "heuristic's (pages/splits/warps/stages). vs_bf16: tokens/s over the BF16 kernel "
              "of the same case. vasm_*: the FP8 kernel with V converted by inline PTX "
              "(`DecodeConfig.v_convert=\"asm\"`); vasm_speedup = cast us / asm us; vasm_err "
              "vs the cast kernel's output. jax_*: JAX's `paged_attention` (block_h 16, 8 pages "
              "per block, 16 splits), D 128 BF16 only; jax_err vs our output. Wall time "
              f"{time.perf_counter() - start:.0f} s.\n\n{table(rows, GRID_COLS)}\n", args.out)
        return
    parts = []
    if not args.prefill:
        rows, hbm = bench(cases or (QUICK if args.quick else CASES))
        cols = ["B", "ctx", "heads", "D", "kv", "us", "host_us", "busy_us", "launches", "kv_MB",
                "GBps", "frac_hbm", "busy_frac_hbm", "tok_per_s", "jax_us", "vs_jax",
                "busy_vs_jax", "xla_ref_us", "rel_err"]
        parts += [f"## paged_attention decode ({device}, page {PAGE})", "",
                  f"HBM copy {hbm / 1e12:.2f} TB/s (measured in this run). {method}; host_us: "
                  "ours with one host dispatch per call (`time_jax`); busy_us: the GPU time of our "
                  "step's kernels (CUPTI via torch.profiler; `launches` per step), the floor of a "
                  "CUDA-graph replay; busy_vs_jax: JAX's kernel's busy time over ours.", "",
                  table(rows, cols), ""]
    if args.decode:
        _emit("\n".join(parts), args.out)
        return
    check = prefill_check()
    rate = dense_matmul_rate()
    rows = bench_prefill(QUICK_PREFILL if args.quick else PREFILL_CASES, rate)
    cols = ["B", "prefix", "chunk", "heads", "D", "kv", "us", "TFLOPs", "roofline_us",
            "frac_roof", "cudnn_us", "vs_cudnn", "xla_ref_us", "vs_xla", "rel_err",
            "kv_write_us", "write_share"]
    parts += [f"## paged_attention prefill ({device}, page {PAGE})", "",
              "Correctness on this GPU (kernel vs reference):", "",
              table(check, list(check[0])), "",
              f"Dense bf16 matmul {rate / 1e12:.0f} TFLOP/s (measured in this run); roofline = "
              "causal FLOPs (4 * D * Hq * visible pairs) at that rate", "",
              table(rows, cols), ""]
    text = "\n".join(parts)
    print(text)
    if args.out:
        args.out.write_text(text)
    if any(r["ok"] != "PASS" for r in check):
        sys.exit("prefill correctness check FAILED (see the table above)")


if __name__ == "__main__":
    main()
