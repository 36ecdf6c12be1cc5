"""Paged-attention decode benchmark: our Pallas kernel (BF16 / FP8 / NVFP4 KV) against JAX's
`pallas.ops.gpu.paged_attention` (BF16) and the XLA gather reference, with the HBM copy
bandwidth measured in the same run.

    python benchmarks/paged_attention.py [--quick] [--out results.md]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import hbm_copy_bandwidth, table, time_jax  # noqa: E402
from pallas_kernels.paged_attention import (  # noqa: E402
    kv_bytes_per_token,
    paged_decode,
    paged_decode_reference,
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
    pages_per_seq = ctx // PAGE
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
        kw = dict(kv_dtype=dtype, scale=d**-0.5)
        if dtype != "bf16":
            kw.update(k_scale=cache.get("k_scale"), v_scale=cache.get("v_scale"))
        if dtype == "nvfp4":
            kw.update(k_global_scale=cache["k_global_scale"],
                      v_global_scale=cache["v_global_scale"])
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        sys.exit("benchmarks/paged_attention.py needs a GPU")
    rows, hbm = bench(QUICK if args.quick else CASES)
    cols = ["B", "ctx", "heads", "D", "kv", "us", "kv_MB", "GBps", "frac_hbm", "tok_per_s",
            "jax_us", "vs_jax", "xla_ref_us", "rel_err"]
    text = "\n".join([
        f"## paged_attention decode ({datetime.date.today()}, {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}, page {PAGE})", "",
        f"HBM copy {hbm / 1e12:.2f} TB/s (measured in this run)", "", table(rows, cols), ""])
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
