"""Grouped-matmul benchmark (MoE prefill): our Pallas kernel in every format against
torch._grouped_mm (bf16), JAX's ragged_dot_mgpu (bf16) and jax.lax.ragged_dot, with the dense
bf16 matmul rate and HBM bandwidth measured in the same run.

    python benchmarks/grouped_matmul.py [--quick] [--tokens 512 4096 ...] [--all-formats]
        [--shapes ...] [--out results.md]

Step 1 checks the kernel against the plain-jnp reference on the GPU (every format, fused
activation, W8A8, skewed and empty groups); step 2 times. Needs a GPU (torch optional).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from atlas_jax.config import Format  # noqa: E402
from atlas_jax.quant import QTensor, quantize  # noqa: E402
from benchmarks._common import (  # noqa: E402
    dense_matmul_rate,
    hbm_copy_bandwidth,
    table,
    time_jax,
    time_torch,
)
from pallas_kernels.grouped_matmul import (  # noqa: E402
    grouped_matmul,
    grouped_matmul_mosaic,
    grouped_matmul_reference,
    quantize_activations_fp8,
)

SHAPES = {  # name: (H, I, E, k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
    "gpt-oss-120b": (2880, 2880, 128, 4),
}
FORMATS = ["bf16", "bf16_mosaic", "fp8_block", "fp8_w8a8", "nvfp4", "mxfp4"]
# bf16: the Triton-lowered kernel (every NVIDIA generation); bf16_mosaic: the Mosaic GPU kernel
# (TMA + wgmma, Hopper), which KernelConfig(gmm_kernel="auto") picks on sm_90


def routing_group_sizes(key, tokens: int, experts: int, k: int) -> jax.Array:
    """Group sizes of random top-k routing (k distinct experts per token)."""
    scores = jax.random.uniform(key, (tokens, experts))
    ids = jax.lax.top_k(scores, k)[1].reshape(-1)
    return jnp.bincount(ids, length=experts).astype(jnp.int32)


def kernel_args(q: QTensor, fmt: str) -> dict:
    """Raw arrays of a QTensor for the kernel's keyword interface."""
    kw = dict(fmt=q.format.value, scale=q.scale, global_scale=q.global_scale)
    if q.format is Format.FP8_BLOCK:
        kw["block_size"] = q.block
    if fmt == "fp8_w8a8":
        kw["act_quant"] = "fp8"
    return kw


WEIGHT_FORMAT = {"bf16": Format.BF16, "bf16_mosaic": Format.BF16, "fp8_block": Format.FP8_BLOCK,
                 "fp8_w8a8": Format.FP8_BLOCK, "nvfp4": Format.NVFP4, "mxfp4": Format.MXFP4}


def make_weight(key, g: int, n: int, k: int, fmt: str, chunk: int = 16) -> QTensor:
    """Random [g, n, k] weights in ``fmt``, quantized ``chunk`` experts at a time (the f32
    intermediates of a whole DeepSeek-V3 stack would not fit next to everything else)."""

    @jax.jit
    def part(i):
        w = jax.random.normal(jax.random.fold_in(key, i), (chunk, n, k), jnp.bfloat16)
        return quantize(w * (k**-0.5), WEIGHT_FORMAT[fmt])

    parts = [part(i) for i in range(-(-g // chunk))]
    q = jax.tree.map(lambda *xs: jnp.concatenate(xs)[:g], *parts)
    return dataclasses.replace(q, shape=(g, n, k))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ---------------------------------------------------------------------------------------------
# step 1: correctness on the GPU
# ---------------------------------------------------------------------------------------------


def kernel_fn(q: QTensor, fmt: str):
    """The jitted kernel entry for ``fmt``: ``fn(x, w_data, group_sizes, **extra)``."""
    if fmt == "bf16_mosaic":
        return jax.jit(grouped_matmul_mosaic)
    return jax.jit(functools.partial(grouped_matmul, **kernel_args(q, fmt)))


def check_correctness() -> list[dict]:
    rows = []
    key = jax.random.key(0)
    cases = [  # (M, N, K, G, group_sizes pattern)
        (1000, 384, 512, 8, "random"),
        (777, 320, 256, 16, "skewed+empty"),
    ]
    for m, n, k, g, pattern in cases:
        kx, kw, kg = jax.random.split(jax.random.fold_in(key, m), 3)
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        if pattern == "random":
            gs = routing_group_sizes(kg, m // 2, g, 2)
        else:
            gs = jnp.zeros((g,), jnp.int32).at[0].set(0).at[3].set(m - 40).at[g - 1].set(17)
        for fmt in FORMATS:
            q = make_weight(kw, g, n, k, fmt)
            xin = x
            if fmt == "fp8_w8a8":  # quantize once: both sides must see the same e4m3 values
                xin, x_scale = quantize_activations_fp8(x)
            for activation in (None, "silu", "gpt_oss"):
                kwargs = kernel_args(q, fmt)
                if fmt == "fp8_w8a8":
                    kwargs.update(act_quant="none", x_scale=x_scale)
                if activation:
                    kwargs.update(activation=activation,
                                  gate_up_layout="interleaved" if activation == "gpt_oss"
                                  else "concatenated")
                ref = grouped_matmul_reference(xin, q.data, gs, out_dtype=jnp.float32, **kwargs)
                if fmt == "bf16_mosaic":
                    kwargs = {k: v for k, v in kwargs.items()
                              if k in ("activation", "gate_up_layout")}
                    if kwargs.get("gate_up_layout") == "interleaved":
                        continue  # the Mosaic kernel takes concatenated gate|up only
                    out = grouped_matmul_mosaic(xin, q.data, gs, out_dtype=jnp.float32, **kwargs)
                else:
                    out = grouped_matmul(xin, q.data, gs, out_dtype=jnp.float32, **kwargs)
                err = rel_err(out, ref)
                ok = bool(np.isfinite(np.asarray(out)).all()) and err < 2e-2
                rows.append(dict(M=m, N=n, K=k, G=g, groups=pattern, format=fmt,
                                 activation=activation or "-", rel_err=err,
                                 ok="yes" if ok else "NO"))
    return rows


def check_moe_forward() -> list[dict]:
    """The library path: moe_forward's prefill through ops.grouped_matmul ("pallas"; gmm_kernel
    "auto" takes the Mosaic kernel for BF16 on sm_90, "mosaic" forces it) vs the XLA path."""
    import atlas_jax as aj
    from atlas_jax.config import MoEConfig

    rows = []
    h, inter, e, k, t = 1024, 512, 16, 4, 300
    x = jax.random.normal(jax.random.key(5), (t, h), jnp.bfloat16)
    step = jax.jit(aj.moe_forward, static_argnames="kernels")
    for fmt, gmm in ((Format.BF16, "auto"), (Format.BF16, "mosaic"), (Format.BF16, "triton"),
                     (Format.NVFP4, "auto")):
        cfg = MoEConfig(hidden_size=h, intermediate_size=inter, num_experts=e, top_k=k,
                        expert_format=fmt)
        p = aj.moe.init_params(jax.random.key(6), cfg, dtype=jnp.bfloat16)
        ours = aj.KernelConfig(grouped_matmul="pallas", moe_path="prefill", gmm_kernel=gmm)
        ref = aj.KernelConfig(grouped_matmul="xla", moe_path="prefill")
        try:
            err = rel_err(step(p, x, kernels=ours), step(p, x, kernels=ref))
            ok = "yes" if err < 2e-2 else "NO"
        except Exception as exc:  # report, do not hide
            err, ok = f"{type(exc).__name__}: {str(exc)[:80]}", "NO"
        rows.append(dict(M=t * k, N=2 * inter, K=h, G=e, groups="routed",
                         format=f"moe_forward {fmt.value}", activation=f"silu, gmm_kernel={gmm}",
                         rel_err=err, ok=ok))
    return rows


# ---------------------------------------------------------------------------------------------
# step 2: timings
# ---------------------------------------------------------------------------------------------


def torch_grouped_mm(x: jax.Array, w: jax.Array, gs: jax.Array):
    """A zero-arg callable running torch._grouped_mm on copies of the inputs, or None."""
    try:
        import torch
    except ImportError:
        return None
    tx = torch.from_dlpack(x)
    tw = torch.from_dlpack(w).transpose(-2, -1)  # [G, K, N] view of [G, N, K]
    offs = torch.from_dlpack(jnp.cumsum(gs).astype(jnp.int32))
    return lambda: torch._grouped_mm(tx, tw, offs=offs, out_dtype=torch.bfloat16)


def _free_torch_cache() -> None:
    try:
        import torch

        torch.cuda.empty_cache()
    except ImportError:
        pass


def mgpu_ragged_dot(n: int):
    """JAX's Mosaic-GPU ragged_dot (bf16), jitted once for output width ``n``."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    block_n = 128
    if n % block_n:
        raise ValueError(f"N={n} is not a multiple of block_n={block_n}")
    grid_block_n = next(b for b in (4, 2, 1) if (n // block_n) % b == 0)
    f = jax.jit(functools.partial(
        ragged_dot_mgpu.ragged_dot, block_m=128, block_n=block_n, block_k=64,
        max_concurrent_steps=4, grid_block_n=grid_block_n, transpose_rhs=True))
    return lambda x, w, group_sizes: f(x, w, group_sizes=group_sizes)


def bench(token_counts: list[int], shapes: list[str], all_formats: bool = False,
          ops: tuple[str, ...] = ("gate_up", "down")
          ) -> tuple[list[dict], dict]:
    import time

    ceilings = dict(hbm=hbm_copy_bandwidth(), mm=dense_matmul_rate())
    rows = []
    key = jax.random.key(1)
    for shape in shapes:
        h, inter, e, k = SHAPES[shape]
        for op, (n, kdim) in (("gate_up", (2 * inter, h)), ("down", (h, inter))):
            if op not in ops:
                continue
            for tokens in token_counts:
                formats = (FORMATS if tokens == 4096 or all_formats
                           else ["bf16", "bf16_mosaic", "nvfp4"])
                m = tokens * k
                gs = routing_group_sizes(jax.random.fold_in(key, tokens), tokens, e, k)
                x = jax.random.normal(jax.random.fold_in(key, 7), (m, kdim), jnp.bfloat16)
                flops = 2.0 * m * n * kdim
                base = dict(shape=shape, op=op, tokens=tokens, M=m, N=n, K=kdim)
                t0 = time.perf_counter()
                wb = make_weight(key, e, n, kdim, "bf16")
                peers = {}
                f = torch_grouped_mm(x, wb.data, gs)
                if f is not None:
                    peers["torch"] = time_torch(f)
                try:
                    peers["mgpu"] = time_jax(mgpu_ragged_dot(n), x, wb.data, gs)
                except Exception as err:  # report, do not hide: the table says why
                    peers["mgpu_error"] = f"{type(err).__name__}: {str(err)[:60]}"
                # lax.ragged_dot materializes an f32 [M, N] product per group (it reads every
                # expert); at 135 GB XLA aborted the process instead of raising
                rd_gb = 4.0 * m * n * e / 1e9
                if rd_gb > 64:
                    peers["ragged_dot_error"] = f"skipped: would materialize {rd_gb:.0f} GB"
                elif tokens <= 4096:
                    rd = jax.jit(lambda a, b, g: jax.lax.ragged_dot(
                        a, jnp.swapaxes(b, 1, 2), g))
                    try:
                        peers["ragged_dot"] = time_jax(rd, x, wb.data, gs, iters=2, repeats=3,
                                                       warmup=1)
                    except Exception as err:  # e.g. out of memory: it materializes a lot
                        peers["ragged_dot_error"] = f"{type(err).__name__}: {str(err)[:60]}"
                del wb, f
                _free_torch_cache()
                for fmt in formats:
                    q = make_weight(key, e, n, kdim, fmt)
                    try:
                        t = time_jax(kernel_fn(q, fmt), x, q.data, gs)
                    except Exception as err:  # report, do not hide: the table says why
                        rows.append(dict(base, format=fmt,
                                         us=f"{type(err).__name__}: {str(err)[:80]}"))
                        print(table([rows[-1]], list(rows[-1])), flush=True)
                        continue
                    row = dict(base, format=fmt, us=t * 1e6, tflops=flops / t / 1e12,
                               frac_dense=flops / t / ceilings["mm"])
                    if "torch" in peers:
                        row["torch_tflops"] = flops / peers["torch"] / 1e12
                        row["vs_torch"] = peers["torch"] / t
                    if "mgpu" in peers:
                        row["mgpu_tflops"] = flops / peers["mgpu"] / 1e12
                        row["vs_mgpu"] = peers["mgpu"] / t
                    else:
                        row["mgpu_tflops"] = peers.get("mgpu_error", "")
                    if "ragged_dot" in peers:
                        row["ragged_dot_tflops"] = flops / peers["ragged_dot"] / 1e12
                    else:
                        row["ragged_dot_tflops"] = peers.get("ragged_dot_error", "")
                    rows.append(row)
                    del q
                    print(table([row], list(row)), flush=True)
                print(f"# {shape} {op} {tokens}: {time.perf_counter() - t0:.1f}s", flush=True)
    return rows, ceilings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="4096 tokens only")
    parser.add_argument("--tokens", type=int, nargs="+", help="token counts (default 512 4096 "
                        "16384; --quick: 4096)")
    parser.add_argument("--all-formats", action="store_true",
                        help="every format at every token count (default: all at 4096 only)")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--ops", nargs="+", default=["gate_up", "down"],
                        choices=["gate_up", "down"])
    parser.add_argument("--out", type=Path, help="write the markdown tables here")
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        sys.exit("benchmarks/grouped_matmul.py needs a GPU")
    device = jax.devices()[0]
    lines = [f"## grouped_matmul ({datetime.date.today()}, {device.device_kind}, jax "
             f"{jax.__version__})", ""]
    if not args.skip_check:
        check = check_correctness() + check_moe_forward()
        lines += ["### Correctness on the GPU (kernel vs reference; moe_forward pallas vs XLA)", "",
                  table(check, list(check[0])), ""]
        print("\n".join(lines), flush=True)
        bad = [r for r in check if r["ok"] != "yes"]
        if bad:
            print(f"{len(bad)} correctness failures", flush=True)
    tokens = args.tokens or ([4096] if args.quick else [512, 4096, 16384])
    rows, ceilings = bench(tokens, args.shapes, args.all_formats, tuple(args.ops))
    cols = ["shape", "op", "tokens", "format", "us", "tflops", "torch_tflops", "vs_torch",
            "mgpu_tflops", "vs_mgpu", "ragged_dot_tflops", "frac_dense"]
    lines += [f"HBM copy {ceilings['hbm'] / 1e12:.2f} TB/s, dense bf16 matmul "
              f"{ceilings['mm'] / 1e12:.0f} TFLOP/s (measured in this run)", "",
              table(rows, cols), ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
