"""The Pallas Triton kernels of every supported model's MoE layer and attention shapes, lowered
and compiled for a GPU on a machine without one: a lowering error, or a kernel whose shared
memory passes the device's, shows here before a user meets it.

Each case is lowered by jax for CUDA under an abstract device (the heuristics see its kind and
SM count): ``moe_forward`` of each MoE model type of ``tests/hf_configs.py`` in BF16 / FP8 /
NVFP4 / MXFP4 (Pallas, Triton kernels: decode at 1 / 8 / 64 tokens, prefill at 512), and the
paged decode (Q 1 and 4) and prefill (512 tokens) of each Qwen3-style attention shape over BF16
/ FP8 / NVFP4 caches. The Triton modules (TTIR, as jax hands them to XLA) are then compiled by
a separate Python with the ``triton`` package (``--triton-python``; 3.6 read them) to PTX, and
ptxas of ``--cuda-root`` reports registers and spill stores. That Triton is not XLA's own (a
newer fork), so registers and spills are indicative; the lowering, each kernel's shared memory
(set by its tiles and stages) and the budget check are not.

    python -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install triton==3.6.0
    python benchmarks/triton_offline.py --triton-python /tmp/tvenv/bin/python
        [--device h200 | gb10] [--families moe attention] [--models qwen3_moe ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEVICES = {  # name: (device_kind, SMs, compute capability, shared memory a block in KB)
    "h200": ("NVIDIA H200", 132, 90, 227),
    "gb10": ("NVIDIA GB10", 48, 121, 99),
}
FORMATS = ("bf16", "fp8_block", "nvfp4", "mxfp4")
MOE_PATHS = (("decode", 1), ("decode", 8), ("decode", 64), ("prefill", 512))
ATTENTION = {  # name: (query heads, KV heads, head_dim, options)
    "qwen3_moe": (32, 4, 128, {}), "qwen2_moe": (16, 16, 128, {}), "mixtral": (32, 8, 128, {}),
    "gpt_oss": (64, 8, 64, dict(sinks=True, sliding_window=128)),
    "qwen3_next": (16, 2, 256, {}), "qwen3_235b": (64, 4, 128, {})}

# The compile step, run by --triton-python: reads [(case, [(ttir, warps, stages)])] and prints
# one JSON line a kernel.
_COMPILE = r"""
import json, os, pickle, re, subprocess, sys, tempfile
from triton.backends.compiler import GPUTarget
from triton.compiler import compile as tcompile
cases, cap, ptxas = pickle.load(sys.stdin.buffer), int(sys.argv[1]), sys.argv[2]
done = {}
SCOPED = '"gpu.barrier"() <{scope = #gpu.barrier_scope<workgroup>}>'
for case, kernels in cases:
    for text, warps, stages in kernels:
        key = (text, warps, stages)
        if key not in done:
            name = re.search(r'sym_name = "([^"]+)"', text).group(1)
            row = dict(kernel=name, warps=warps)
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "k.ttir")
                with open(path, "w") as f:  # an attribute this Triton's MLIR does not know
                    f.write(text.replace(SCOPED, '"gpu.barrier"()'))
                try:
                    k = tcompile(path, target=GPUTarget("cuda", cap, 32),
                                 options=dict(num_warps=warps, num_stages=stages))
                    with open(os.path.join(d, "k.ptx"), "w") as f:
                        f.write(k.asm["ptx"])
                    out = subprocess.run([ptxas, "-v", f"-arch=sm_{cap}a", os.path.join(d, "k.ptx"),
                                          "-o", os.path.join(d, "k.cubin")], capture_output=True,
                                         text=True)
                    report = out.stdout + out.stderr
                    regs = re.search(r"Used (\d+) registers", report)
                    spills = re.search(r"(\d+) bytes spill stores", report)
                    row.update(smem_kb=round(k.metadata.shared / 1024, 1),
                               registers=int(regs.group(1)) if regs else report[-200:],
                               spills=int(spills.group(1)) if spills else 0)
                except Exception as err:
                    row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            done[key] = row
        print(json.dumps(dict(case=case, **done[key])), flush=True)
"""


def _capturing():
    """Patches jax's Pallas Triton lowering to keep each module's TTIR (generic form) with
    its warps and stages; returns the list they go to."""
    from jax._src.interpreters import mlir
    from jax._src.pallas.triton import pallas_call_registration as registration

    captured = []
    lower_module = registration.lowering.lower_jaxpr_to_triton_module
    custom_call = mlir.custom_call

    def keep_module(*args, **kwargs):
        result = lower_module(*args, **kwargs)
        captured.append([result.module.operation.get_asm(print_generic_op_form=True)])
        return result

    def keep_params(*args, backend_config=None, **kwargs):
        if kwargs.get("call_target_name", args[0] if args else None) == "__gpu$xla.gpu.triton":
            captured[-1] += [int(str(backend_config[k]).split(":")[0])
                             for k in ("num_warps", "num_stages")]
        return custom_call(*args, backend_config=backend_config, **kwargs)

    registration.lowering.lower_jaxpr_to_triton_module = keep_module
    mlir.custom_call = keep_params
    return captured


def _moe_cases(models):
    """``(case, function, abstract args)`` of ``moe_forward`` a model x format x path."""
    import jax
    import jax.numpy as jnp

    import atlas_jax as aj
    from atlas_jax.config import Format
    from tests.hf_configs import HF_CONFIGS, MOE_MODEL_TYPES  # real config.json contents

    for model in models or MOE_MODEL_TYPES:
        for fmt in FORMATS:
            cfg = dataclasses.replace(aj.MoEConfig.from_hf_config(HF_CONFIGS[model]),
                                      expert_format=Format(fmt))
            params = jax.eval_shape(lambda cfg=cfg: aj.moe.init_params(jax.random.key(0), cfg))
            for path, tokens in MOE_PATHS:
                kernels = aj.KernelConfig(grouped_matmul="pallas", router="pallas",
                                          moe_path=path, decode_kernel="triton",
                                          gmm_kernel="triton")
                args = [params, jax.ShapeDtypeStruct((tokens, cfg.hidden_size), jnp.bfloat16)]
                if cfg.hash_routing:
                    args.append(jax.ShapeDtypeStruct((tokens,), jnp.int32))

                def f(p, x, ids=None, kernels=kernels):
                    return aj.moe_forward(p, x, token_ids=ids, kernels=kernels)

                yield f"moe {model} {fmt} {path} T={tokens}", f, args


def _attention_cases(models):
    """``(case, function, abstract args)`` of the paged decode / prefill a shape x KV dtype."""
    import jax
    import jax.numpy as jnp

    from atlas_jax.config import KVDtype
    from pallas_kernels.paged_attention import paged_decode, paged_prefill

    sd = jax.ShapeDtypeStruct
    store = {KVDtype.BF16: jnp.bfloat16, KVDtype.FP8: jnp.float8_e4m3fn,
             KVDtype.NVFP4: jnp.uint8}
    pages, page, table = 1024, 16, 64
    for name in models or ATTENTION:
        if name not in ATTENTION:
            continue
        hq, hk, d, options = ATTENTION[name]
        for kv in store:
            width = d // 2 if kv is KVDtype.NVFP4 else d
            arrays = dict(k_pages=sd((pages, page, hk, width), store[kv]),
                          v_pages=sd((pages, page, hk, width), store[kv]))
            if kv is KVDtype.FP8:
                arrays |= dict(k_scale=sd((pages, page, hk), jnp.float32),
                               v_scale=sd((pages, page, hk), jnp.float32))
            if kv is KVDtype.NVFP4:
                scale = sd((pages, page, hk, d // 16), jnp.float8_e4m3fn)
                glob = sd((pages, page, hk), jnp.float32)
                arrays |= dict(k_scale=scale, v_scale=scale, k_global_scale=glob,
                               v_global_scale=glob)
            opts = dict(options)
            if opts.pop("sinks", False):
                arrays["sinks"] = sd((hq,), jnp.float32)
            for kind, q_len in (("decode", 1), ("decode", 4), ("prefill", 512)):
                b = 4 if kind == "decode" else 2
                lens = sd((b,) if kind == "decode" else (b, q_len), jnp.int32)

                def f(q, tables, lens, arrays, kind=kind, kv=kv, d=d, opts=opts):
                    arrays = dict(arrays)
                    fn = paged_decode if kind == "decode" else paged_prefill
                    return fn(q, arrays.pop("k_pages"), arrays.pop("v_pages"), tables, lens,
                              kv_dtype=kv, scale=d**-0.5, **arrays, **opts)

                yield (f"attention {name} kv {kv.value} {kind} Q={q_len}", f,
                       [sd((b, q_len, hq, d), jnp.bfloat16), sd((b, table), jnp.int32), lens,
                        arrays])


def lower_all(device: str, families, models) -> list:
    """``[(case, [(ttir, warps, stages)] or an error string)]`` for the device's abstract
    GPU."""
    import jax

    from pallas_kernels._device import abstract_gpu

    for name in ("_dispatch", "routing", "grouped_matmul", "moe_decode", "paged_attention"):
        #   the compiled kernels, not the interpreter (each op module imported the function)
        importlib.import_module(f"atlas_jax.ops.{name}").interpret_mode = lambda: False
    captured = _capturing()
    kind, sms, _, _ = DEVICES[device]
    cases = [c for fam, make in (("moe", _moe_cases), ("attention", _attention_cases))
             if fam in families for c in make(models)]
    out = []
    for case, f, args in cases:
        captured.clear()
        try:
            with abstract_gpu(kind, sms):
                jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
            out.append((case, [tuple(c) for c in captured]))
        except Exception as err:  # reported in the table
            out.append((case, f"{type(err).__name__}: {str(err)[:200]}"))
        print(f"lowered {case}: {len(captured)} Triton kernels", file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--triton-python", required=True,
                        help="a Python with the triton package (a side venv)")
    parser.add_argument("--cuda-root", type=Path, default=Path("/usr/local/cuda"))
    parser.add_argument("--device", choices=list(DEVICES), default="h200")
    parser.add_argument("--families", nargs="+", choices=["moe", "attention"],
                        default=["moe", "attention"])
    parser.add_argument("--models", nargs="*", help="model types (default: all)")
    args = parser.parse_args()
    lowered = lower_all(args.device, args.families, args.models)
    ok = [(case, k) for case, k in lowered if not isinstance(k, str)]
    _, _, cap, smem_kb = DEVICES[args.device]
    print(f"| case | kernel | warps | registers | spill stores | SMEM KB (of {smem_kb}) |")
    print("|---|---|---|---|---|---|")
    for case, err in lowered:
        if isinstance(err, str):
            print(f"| {case} | lowering error: {err} | | | | |")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "compile.py"
        script.write_text(_COMPILE)
        proc = subprocess.run([args.triton_python, str(script), str(cap),
                               str(args.cuda_root / "bin" / "ptxas")], input=pickle.dumps(ok),
                              capture_output=True, env=dict(os.environ, PYTHONPATH=""))
    if proc.returncode:
        sys.exit(proc.stderr.decode()[-3000:])
    for line in proc.stdout.decode().splitlines():
        row = json.loads(line)
        if "error" in row:
            print(f"| {row['case']} | {row['kernel']} | {row['warps']} | compile error: "
                  f"{row['error']} | | |")
            continue
        over = " **over**" if row["smem_kb"] > smem_kb else ""
        print(f"| {row['case']} | {row['kernel']} | {row['warps']} | {row['registers']} | "
              f"{row['spills']} | {row['smem_kb']}{over} |")


if __name__ == "__main__":
    main()
