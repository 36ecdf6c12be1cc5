"""Paged-attention benchmark: our Pallas kernels (BF16 / FP8 / NVFP4 KV) with the ceilings
measured in the same run.

* decode: against JAX's `pallas.ops.gpu.paged_attention` (BF16) and the XLA gather reference,
  and the HBM copy bandwidth (decode reads every KV byte once);
* prefill (``--prefill`` runs it alone): first a correctness check of the kernel against the
  reference on this GPU (ragged batch, chunk after a cached prefix, padding, window, softcap,
  sinks; every KV dtype), then prompts of 4k / 16k tokens and a 2k chunk after a 14k prefix
  against the XLA reference (where its [S, L] logits fit), cuDNN's dense causal flash attention
  on contiguous K/V (``jax.nn.dot_product_attention``, fresh BF16 prompts), and the roofline of
  the causal FLOPs at the dense bf16 matmul rate; plus the XLA KV write of the chunk
  (``PagedKVCache.write``: quantize + slot-mapping scatter, donated cache) timed on its own, and
  its share of write + attention.

    python benchmarks/paged_attention.py [--quick] [--prefill] [--out results.md]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    dense_matmul_rate,
    hbm_copy_bandwidth,
    table,
    time_jax,
)
from pallas_kernels.paged_attention import (  # noqa: E402
    DecodeConfig,
    kv_bytes_per_token,
    paged_decode,
    paged_decode_reference,
    paged_prefill,
    paged_prefill_reference,
)

PAGE = 16
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


def make_cache(key, b: int, ctx: int, hk: int, d: int, dtype: str) -> dict:
    """Random pages (never zeros), scattered block tables and every sequence at ``ctx``."""
    pages_per_seq = -(-ctx // PAGE)
    n = b * pages_per_seq + 7
    rng = np.random.default_rng(0)
    kk, kv = jax.random.split(key)
    shape = (n, PAGE, hk, d)
    args = {}
    for name, k in (("k", kk), ("v", kv)):
        match dtype:
            case "bf16":
                args[f"{name}_pages"] = jax.random.normal(k, shape, jnp.bfloat16)
            case "fp8":
                args[f"{name}_pages"] = jax.random.normal(k, shape).astype(jnp.float8_e4m3fn)
                args[f"{name}_scale"] = jax.random.uniform(k, shape[:3], minval=0.5, maxval=1.5)
            case "nvfp4":
                args[f"{name}_pages"] = jax.random.randint(
                    k, (*shape[:3], d // 2), 0, 256).astype(jnp.uint8)
                args[f"{name}_scale"] = jnp.asarray(
                    rng.uniform(0.5, 2.0, (*shape[:3], d // 16)).astype(ml_dtypes.float8_e4m3fn))
                args[f"{name}_global_scale"] = jnp.full(shape[:3], 0.1, jnp.float32)
    perm = rng.permutation(n)[: b * pages_per_seq].reshape(b, pages_per_seq)
    return dict(args, block_tables=jnp.asarray(perm, jnp.int32),
                seq_lens=jnp.full((b,), ctx, jnp.int32))


def kernel_kwargs(cache: dict, dtype: str, d: int) -> dict:
    """kv_dtype, softmax scale and the scale arrays of ``cache`` as the kernels take them."""
    kw = dict(kv_dtype=dtype, scale=d**-0.5)
    for name in ("k_scale", "v_scale", "k_global_scale", "v_global_scale"):
        if name in cache:
            kw[name] = cache[name]
    return kw


def jax_paged_attention(q, cache):
    from jax.experimental.pallas.ops.gpu import paged_attention as jpa

    k = jnp.transpose(cache["k_pages"], (2, 0, 1, 3))  # [Hk, N, P, D] (outside the timing)
    v = jnp.transpose(cache["v_pages"], (2, 0, 1, 3))
    fn = jax.jit(functools.partial(jpa.paged_attention, block_h=16, pages_per_compute_block=8,
                                   k_splits=16))
    return lambda: fn(q[:, 0], k, v, cache["block_tables"], cache["seq_lens"])


def bench(cases) -> tuple[list[dict], float]:
    hbm = hbm_copy_bandwidth()
    rows = []
    key = jax.random.key(0)
    for b, ctx, hq, hk, d, dtype in cases:
        cache = make_cache(key, b, ctx, hk, d, dtype)
        q = jax.random.normal(jax.random.fold_in(key, 1), (b, 1, hq, d), jnp.bfloat16)
        kw = kernel_kwargs(cache, dtype, d)
        pos = (q, cache["k_pages"], cache["v_pages"], cache["block_tables"], cache["seq_lens"])
        ours = jax.jit(functools.partial(paged_decode, **kw))
        ref = jax.jit(functools.partial(paged_decode_reference, **kw))
        err = float(jnp.linalg.norm(ours(*pos).astype(jnp.float32) - ref(*pos))
                    / jnp.linalg.norm(ref(*pos)))
        t = time_jax(ours, *pos)
        t_ref = time_jax(ref, *pos, iters=5, repeats=3)
        kv_bytes = b * ctx * kv_bytes_per_token(dtype, hk, d)
        row = dict(B=b, ctx=ctx, heads=f"{hq}/{hk}", D=d, kv=dtype, us=t * 1e6,
                   kv_MB=kv_bytes / 1e6, GBps=kv_bytes / t / 1e9, frac_hbm=kv_bytes / t / hbm,
                   tok_per_s=b / t, xla_ref_us=t_ref * 1e6, rel_err=err)
        if dtype == "bf16":
            try:
                t_jax = time_jax(jax_paged_attention(q, cache))
                row.update(jax_us=t_jax * 1e6, vs_jax=t_jax / t)
            except Exception as e:  # report, do not hide
                row["jax_us"] = f"{type(e).__name__}: {str(e)[:50]}"
        rows.append(row)
        print(table([row], list(row)), flush=True)
        del cache
    return rows, hbm


# ---- decode config sweep ---------------------------------------------------------------------

SWEEP = {  # case -> (pages_per_step, num_splits, num_warps, num_stages) variants
    (1, 32768, 32, 4, 128, "bf16"): [(pp, s, 4, st) for pp in (8, 16) for s in (16, 33, 66, 132)
                                     for st in (2, 3)],
    (32, 16384, 32, 4, 128, "fp8"): [(pp, s, 4, st) for pp in (8, 16, 32) for s in (1, 3)
                                     for st in (2, 4)],
}


def sweep() -> list[dict]:
    """Time DecodeConfig variants against the heuristic's choice (each checked against the
    reference) for the cases the targets of issue 8 name and miss: B=1 at 32k, FP8 at 16k."""
    hbm = hbm_copy_bandwidth()
    rows = []
    key = jax.random.key(0)
    for (b, ctx, hq, hk, d, dtype), variants in SWEEP.items():
        cache = make_cache(key, b, ctx, hk, d, dtype)
        q = jax.random.normal(jax.random.fold_in(key, 1), (b, 1, hq, d), jnp.bfloat16)
        kw = kernel_kwargs(cache, dtype, d)
        pos = (q, cache["k_pages"], cache["v_pages"], cache["block_tables"], cache["seq_lens"])
        want = jax.jit(functools.partial(paged_decode_reference, **kw))(*pos)
        kv_bytes = b * ctx * kv_bytes_per_token(dtype, hk, d)
        for v in [None, *variants]:
            config = None if v is None else DecodeConfig(*v)
            fn = jax.jit(functools.partial(paged_decode, **kw, config=config))
            err = float(jnp.linalg.norm(fn(*pos).astype(jnp.float32) - want)
                        / jnp.linalg.norm(want))
            t = time_jax(fn, *pos)
            row = dict(B=b, ctx=ctx, kv=dtype, config="heuristic" if v is None else str(v),
                       us=t * 1e6, frac_hbm=kv_bytes / t / hbm, rel_err=err)
            rows.append(row)
            print(table([row], list(row)), flush=True)
        del cache
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--prefill", action="store_true", help="only the prefill section")
    parser.add_argument("--sweep", action="store_true",
                        help="only: time decode config variants (pages per step, splits, stages)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        sys.exit("benchmarks/paged_attention.py needs a GPU")
    device = f"{datetime.date.today()}, {jax.devices()[0].device_kind}, jax {jax.__version__}"
    if args.sweep:
        rows = sweep()
        text = (f"## paged_attention decode config sweep ({device})\n\n"
                f"{table(rows, list(rows[0]))}\n")
        print(text)
        if args.out:
            args.out.write_text(text)
        return
    parts = []
    if not args.prefill:
        rows, hbm = bench(QUICK if args.quick else CASES)
        cols = ["B", "ctx", "heads", "D", "kv", "us", "kv_MB", "GBps", "frac_hbm", "tok_per_s",
                "jax_us", "vs_jax", "xla_ref_us", "rel_err"]
        parts += [f"## paged_attention decode ({device}, page {PAGE})", "",
                  f"HBM copy {hbm / 1e12:.2f} TB/s (measured in this run)", "",
                  table(rows, cols), ""]
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
