"""ptxas's register count of the Mosaic GPU kernels (MoE decode by default) for sm_90a, on a
machine without a GPU, or the error that stops their compile (SMEM past a CTA's, ...): the
kernel is lowered for CUDA, then compiled to PTX and through ptxas by jax's CUDA PJRT plugin
(``MosaicGpuCompile``), with a stand-in ``libcuda.so.1`` that reports an sm_90 device and
refuses to load the result (the count is printed before that).

Registers set a kernel's CTAs an SM on the H200 (65536 a SM, 128 threads a CTA: <= 102 for 5,
the most the decode kernels' ~43 KB of SMEM allow), which device time is too scarce to sweep.
Counts taken this way matched the H200's own ptxas (88 / 89 / 120 / 133 registers, session 23).

Needs: ``ptxas`` and ``nvvm/libdevice`` of CUDA 13 under ``--cuda-root``, ``gcc``, and the
wheels ``jax-cuda13-pjrt==0.11.2`` and ``jax-cuda13-plugin==0.11.2`` unpacked into
``--plugins`` (``pip download --no-deps -d W jax-cuda13-pjrt==0.11.2 jax-cuda13-plugin==0.11.2``
then ``unzip`` each into one directory); nothing is installed.

    python benchmarks/mosaic_registers.py --plugins DIR [--family moe-decode] [--case qwen3-fp8
        ... | all] [--set H_PROGRAM_ROWS=1 ...] [--rows 8] [--sass NVDISASM]

``--sass`` (the path of an ``nvdisasm``, e.g. from the ``nvidia-cuda-nvdisasm`` wheel) also
dumps each kernel's PTX, assembles it with ``ptxas -arch=sm_90a`` and disassembles it, and
lists its loops (the bodies of backward branches) of 20 instructions or more: their length
and most frequent opcodes, e.g. the FP4 K-step loop's conversion against its fixed costs.

Cases: ``ARCH-{fp8,nvfp4,mxfp4}``, ARCH the routed experts of each supported model type
(``_ARCHS``: qwen3, gptoss, deepseek, qwen2, mixtral, qwen3next, longcat, minimax, deepseekv4,
gemma4; 64 pairs), or ``all``; each row of the table is the one-launch kernel (``slot_mlp``)
and the two ``slot_matmul`` kernels (one program over K; down with its own h where the decode
step at 1-7 tokens would take it, ``mosaic.down_makes_h``, at items of up to 8 rows): ptxas's
registers a thread, its spill stores if any, or the error that stopped the compile.
``--set NAME=VALUE`` sets a ``pallas_kernels.moe_decode.mosaic`` constant first.

``--family paged-decode``: the FP8 paged-attention decode kernel (``paged_attention.mosaic``)
at ``q{Q}-g{G}`` (Q query tokens, G query heads a KV head: R = Q x G rows, at most 64);
``--family grouped-matmul``: the BF16 prefill grouped matmul (``grouped_matmul.mosaic``) on
each architecture's experts (``_ARCHS``, fused gate_up and down, 4096 rows).
"""

from __future__ import annotations

import argparse
import ast
import collections
import ctypes
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_FAKE_LIBCUDA = r"""
#include <string.h>
typedef int CUresult;
static int ctx;
CUresult cuInit(unsigned f) { return 0; }
CUresult cuDriverGetVersion(int* v) { *v = 13000; return 0; }
CUresult cuDeviceGet(int* d, int o) { *d = 0; return 0; }
CUresult cuDeviceGetCount(int* c) { *c = 1; return 0; }
CUresult cuDeviceGetAttribute(int* v, int attr, int d) {  /* 75, 76: compute capability */
  *v = attr == 75 ? 9 : attr == 16 ? 132 : 0; return 0; }
CUresult cuDeviceGetName(char* n, int len, int d) { strncpy(n, "NVIDIA H200", len); return 0; }
CUresult cuCtxGetCurrent(void** c) { *c = &ctx; return 0; }
CUresult cuCtxGetDevice(int* d) { *d = 0; return 0; }
CUresult cuCtxPushCurrent(void* c) { return 0; }
CUresult cuCtxPopCurrent(void** c) { return 0; }
CUresult cuCtxSetCurrent(void* c) { return 0; }
CUresult cuDevicePrimaryCtxRetain(void** c, int d) { *c = &ctx; return 0; }
CUresult cuGetErrorString(CUresult e, const char** s) { *s = "stand-in libcuda"; return 0; }
CUresult cuGetErrorName(CUresult e, const char** s) { *s = "STAND_IN"; return 0; }
CUresult cuModuleLoadData(void** m, const void* i) { return 999; }
"""

_ARCHS = {  # the routed experts of each supported model type: (H, I, gate_up kwargs of slot_mlp)
    "qwen3": (2048, 768, {}),  # Qwen3-30B-A3B
    "gptoss": (2880, 2880, dict(activation="gpt_oss", layout="interleaved", limit=7.0)),
    "deepseek": (7168, 2048, {}),  # DeepSeek-V3
    "qwen2": (2048, 1408, {}),  # Qwen1.5-MoE-A2.7B
    "mixtral": (4096, 14336, {}),  # Mixtral-8x7B
    "qwen3next": (2048, 512, {}),  # Qwen3-Next-80B-A3B
    "longcat": (6144, 2048, {}),  # LongCat-Flash
    "minimax": (3072, 1536, {}),  # MiniMax-M2
    "deepseekv4": (4096, 2048, dict(activation="silu", limit=10.0)),  # DeepSeek-V4-Flash
    "gemma4": (2816, 704, dict(activation="gelu_tanh")),  # Gemma-4-26B-A4B
}
CASES = {f"{arch}-{fmt}": (fmt, *shape) for arch, shape in _ARCHS.items()
         for fmt in ("fp8", "nvfp4", "mxfp4")}  # (format, H, I, gate_up kwargs)
KERNELS = ("slot_mlp", "gate_up", "down")
PAGED_CASES = {f"q{q}-g{g}": (q, g) for q in (1, 2, 3, 4) for g in (1, 4, 6, 8, 16)
               if q * g <= 64}  # G: Qwen1.5-MoE 1, Mixtral 4, MiniMax-M2 6, Qwen3 8, 235B 16
FAMILIES = {  # family: (cases, kernels)
    "moe-decode": (CASES, KERNELS),
    "paged-decode": (PAGED_CASES, ("paged_decode",)),
    "grouped-matmul": (_ARCHS, ("gate_up", "down")),
}


def sass_loops(sass: str, min_length: int = 20) -> list[tuple[str, int, list[tuple[str, int]]]]:
    """The loops of ``nvdisasm -c`` output: for each backward branch ``BRA `(.L_x_N)``` to a
    label above it, ``(label, instructions from the label to the branch, the 8 most frequent
    opcodes with their counts)``, in the order of the branches; loops shorter than
    ``min_length`` are left out (the barrier-wait spins). A branch back from past an inner
    loop (e.g. a wait's retry path placed after the code) spans that loop too."""
    ins, labels = [], {}
    for line in sass.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(ins)
        elif m := re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line):
            ins.append(m.group(1))
    loops = []
    for i, text in enumerate(ins):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", text)
        if not m or labels.get(m.group(1), i + 1) > i:
            continue
        body = ins[labels[m.group(1)]:i + 1]
        if len(body) < min_length:
            continue
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0]
                                  for x in body)
        loops.append((m.group(1), len(body), ops.most_common(8)))
    return loops


def _compile_one(family: str, case: str, kernel: str, plugins: Path, sets: list[str],
                 item_rows: int) -> None:
    """In a child process: lower ``kernel`` of ``case`` and hand its Mosaic GPU modules to
    ``MosaicGpuCompile``, which prints ptxas's report (``MOSAIC_GPU_DUMP_PTXAS``)."""
    import jax
    from jax.experimental.mosaic.gpu import core as mgpu_core

    from pallas_kernels._device import abstract_gpu

    mgpu_core.KNOWN_KERNELS.clear()
    if family == "moe-decode":
        _lower_moe_decode(case, kernel, sets, item_rows)
    else:  # their heuristics ask the device: an abstract H200
        with abstract_gpu():
            f, args = (_paged_decode(*PAGED_CASES[case]) if family == "paged-decode"
                       else _grouped_matmul(*_ARCHS[case], kernel))
            jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    lib = ctypes.CDLL(str(plugins / "jax_plugins" / "xla_cuda13" / "xla_cuda_plugin.so"))
    compile_ = lib.MosaicGpuCompile
    compile_.argtypes = [ctypes.c_char_p, ctypes.c_int]
    compile_.restype = ctypes.POINTER(ctypes.c_void_p)
    for module in mgpu_core.KNOWN_KERNELS.values():  # each fails at the load: expected
        compile_(ctypes.c_char_p(module), ctypes.c_int(len(module)))


def _paged_decode(q_len: int, group: int, kv_heads: int = 4, pages: int = 64, page: int = 16):
    """``paged_decode_mosaic`` at Q x G query rows (two sequences, sinks, two splits)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.paged_attention import paged_decode_mosaic

    sd = jax.ShapeDtypeStruct
    kv = sd((pages, page, kv_heads, 128), jnp.float8_e4m3fn)
    scale = sd((pages, page, kv_heads), jnp.float32)

    def f(q, k, v, table, lens, k_scale, v_scale, sinks):
        return paged_decode_mosaic(q, k, v, table, lens, k_scale=k_scale, v_scale=v_scale,
                                   scale=0.1, sinks=sinks, num_splits=2)

    return f, (sd((2, q_len, kv_heads * group, 128), jnp.bfloat16), kv, kv,
               sd((2, 16), jnp.int32), sd((2,), jnp.int32), scale, scale,
               sd((kv_heads * group,), jnp.float32))


def _grouped_matmul(h: int, inter: int, variant: dict, kernel: str, rows: int = 4096,
                    experts: int = 128):
    """``grouped_matmul_mosaic`` on an architecture's experts: gate_up with its activation
    fused, or down."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.grouped_matmul import grouped_matmul_mosaic, mosaic_unsupported_reason

    sd = jax.ShapeDtypeStruct
    n, k, kw = h, inter, {}
    if kernel == "gate_up":
        n, k = 2 * inter, h
        kw = dict(activation=variant.get("activation", "silu"),
                  gate_up_layout=variant.get("layout", "concatenated"))
        if "limit" in variant:
            kw["limit"] = variant["limit"]
    reason = mosaic_unsupported_reason(
        jnp.bfloat16, jnp.bfloat16, n // (2 if kw else 1), k, fused_gate_up=bool(kw),
        gate_up_layout=kw.get("gate_up_layout", "concatenated"), out_dtype=jnp.float32,
        bias=False)
    if reason:  # the Triton kernel's (ops.grouped_matmul)
        sys.exit(f"unsupported ({reason[:60]})")

    def f(x, w, group_sizes):
        return grouped_matmul_mosaic(x, w, group_sizes, out_dtype=jnp.float32, **kw)

    return f, (sd((rows, k), jnp.bfloat16), sd((experts, n, k), jnp.bfloat16),
               sd((experts,), jnp.int32))


def _lower_moe_decode(case: str, kernel: str, sets: list[str], item_rows: int) -> None:
    """Lower ``kernel`` of the MoE decode ``case`` for CUDA (``jax.export``)."""
    import jax
    import jax.numpy as jnp
    from jax import export

    from pallas_kernels.grouped_matmul.config import Activation, GateUpLayout
    from pallas_kernels.moe_decode import mosaic
    from pallas_kernels.moe_decode.kernel import num_items
    from pallas_kernels.moe_decode.rows import row_width

    for item in sets:
        name, value = item.split("=", 1)
        setattr(mosaic, name, ast.literal_eval(value))
    fmt, h, inter, variant = CASES[case]
    variant = dict(variant, activation=Activation(variant.get("activation", "silu")),
                   layout=GateUpLayout(variant.get("layout", "concatenated")))
    e, p = 128, 64
    packed = 1 if fmt == "fp8" else 2
    w_dtype = jnp.float8_e4m3fn if fmt == "fp8" else jnp.uint8
    spec = jax.ShapeDtypeStruct

    def stack(n, k):  # (w, scale[, global]) of [e, n, k]
        w = spec((e, n, k // packed), w_dtype)
        match fmt:
            case "fp8":
                return [w, spec((e, -(-n // 128), -(-k // 128)), jnp.float32)]
            case "nvfp4":
                return [w, spec((e, n, k // 16), jnp.float8_e4m3fn), spec((e, 1), jnp.float32)]
        return [w, spec((e, n, k // 32), jnp.uint8)]

    gu, dn = stack(2 * inter, h), stack(h, inter)
    tiles = (mosaic.choose_slot_tile(h, fmt=fmt, rows=item_rows),
             mosaic.choose_slot_tile(inter, fmt=fmt, rows=item_rows))
    fp8_block = (128, 128) if fmt == "fp8" else None
    work = spec((3, num_items(e, p, item_rows)), jnp.int32)
    rows = mosaic.window_rows(p, item_rows)
    if kernel == "slot_mlp":
        names = ["gate_up", "down", "gate_up_scale", "down_scale", "gate_up_global_scale",
                 "down_global_scale"][:2 * len(gu)]
        arrays = [v for pair in zip(gu, dn, strict=True) for v in pair]

        def f(work, a, factor, *arrays_):
            return mosaic.slot_mlp(work, a, factor, **dict(zip(names, arrays_, strict=True)),
                                   fmt=fmt, fp8_block=fp8_block, tiles=tiles, **variant)

        a = spec((rows, row_width(h, tiles[0].block_k if packed == 2 else None)), jnp.float16)
    else:
        i = KERNELS.index(kernel) - 1
        arrays, k = (gu, h) if i == 0 else (dn, inter)
        width = row_width(k, tiles[i].block_k if packed == 2 else None)  # a ragged K padded
        a = spec((rows, width), jnp.float16)
        source = None
        if i == 1 and item_rows <= 8 and mosaic.down_makes_h(mosaic.DOWN_MAKES_H_TOKENS, fmt,
                                                             inter, tiles[1], 1):
            #   the down kernel making its own h from gate_up's output (1-7 tokens)
            a = spec((rows, 2 * inter), jnp.float32)
            source = mosaic.HSource(1, variant["activation"], variant["layout"],
                                    variant.get("limit"), mosaic.GPT_OSS_ALPHA)

        def f(work, a, factor, w, scale, global_scale=None):
            return mosaic.slot_matmul(work, a, w, scale, None, global_scale,
                                      row_factor=None if source else factor, fmt=fmt,
                                      fp8_block=fp8_block, tile=tiles[i], h_source=source)

    export.export(jax.jit(f), platforms=["cuda"])(
        work, a, spec((rows,), jnp.float32), *arrays)


def _disassemble(dump: Path, cuda_root: Path, nvdisasm: Path) -> tuple[str, list]:
    """(ptxas's register count, ``sass_loops``) of the PTX that Mosaic GPU dumped into
    ``dump``: assembled here (the dump stops the child before its own ptxas report), then
    disassembled."""
    ptx = sorted(dump.glob("*.ptx"))
    if not ptx:
        return "error: no PTX dumped", []
    cubin = dump / "kernel.cubin"
    report = subprocess.run([str(cuda_root / "bin" / "ptxas"), "-v", "-arch=sm_90a", str(ptx[0]),
                             "-o", str(cubin)], check=True, capture_output=True, text=True)
    sass = subprocess.run([str(nvdisasm), "-c", str(cubin)], check=True, capture_output=True,
                          text=True).stdout
    return _registers(report.stdout + report.stderr), sass_loops(sass)


def _registers(text: str) -> str:
    """ptxas's ``Used N registers`` from its report (with its spill stores where there are
    any), or the report's last line as an error."""
    used = [ln for ln in text.splitlines() if "Used" in ln and "registers" in ln]
    if not used:
        return "error: " + (text.strip().splitlines() or ["no output"])[-1][:80]
    count = used[0].split("Used")[1].split("registers")[0].strip()
    spills = re.search(r"(\d+) bytes spill stores", text)
    return count + (f" (spills {spills.group(1)} B)" if spills and spills.group(1) != "0" else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plugins", type=Path, required=True,
                        help="the unpacked jax-cuda13-pjrt and jax-cuda13-plugin wheels")
    parser.add_argument("--cuda-root", type=Path, default=Path("/usr/local/cuda"))
    parser.add_argument("--family", choices=list(FAMILIES), default="moe-decode")
    parser.add_argument("--case", nargs="+", default=["qwen3-fp8"],
                        help="cases of the family (see the docstring), or all")
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE")
    parser.add_argument("--rows", type=int, default=16,
                        help="the work items' rows (SlotTile.rows: windows of 8 rows for 1 and 8, "
                             "16 for 2-7, 9 and 16, 24 for 10-15; choose_item_rows(T) at T "
                             "tokens)")
    parser.add_argument("--sass", type=Path, metavar="NVDISASM",
                        help="also list each kernel's SASS loops (needs nvdisasm)")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # (case, kernel): the child
    args = parser.parse_args()
    if args.one:
        _compile_one(args.family, *args.one, args.plugins, args.set, args.rows)
        return
    cases, kernels = FAMILIES[args.family]
    chosen = list(cases) if "all" in args.case else args.case
    if unknown := [c for c in chosen if c not in cases]:
        sys.exit(f"--case {' '.join(unknown)}: not a {args.family} case; its cases: "
                 f"{', '.join(cases)}, all")
    if not (args.plugins / "jax_plugins" / "xla_cuda13" / "xla_cuda_plugin.so").exists():
        sys.exit(f"--plugins {args.plugins}: no jax_plugins/xla_cuda13/xla_cuda_plugin.so (see "
                 f"the docstring: pip download, unzip)")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "libcuda.c"
        src.write_text(_FAKE_LIBCUDA)
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(Path(tmp) / "libcuda.so.1"),
                        str(src)], check=True)
        env = dict(os.environ, LD_LIBRARY_PATH=tmp, MOSAIC_GPU_DUMP_PTXAS="1",
                   MOSAIC_GPU_CUDA_ROOT=str(args.cuda_root),
                   MOSAIC_GPU_RUNTIME_LIB_PATH=str(args.plugins / "jax_cuda13_plugin"
                                                   / "libmosaic_gpu_runtime.so"))
        print(f"settings: {' '.join(args.set) or '(the code)'}, items of {args.rows} rows\n")
        print("| case | " + " | ".join(f"{k} registers" for k in kernels) + " |")
        print("|---" * (len(kernels) + 1) + "|")
        loops = []
        for case in chosen:
            counts = []
            for kernel in kernels:
                dump, extra = Path(tmp) / f"{case}-{kernel}", {}
                if args.sass:
                    dump.mkdir()
                    extra = dict(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_TO=str(dump))
                out = subprocess.run(
                    [sys.executable, __file__, "--plugins", str(args.plugins), "--family",
                     args.family, "--one", case, kernel, "--rows", str(args.rows), "--set",
                     *args.set], env=env | extra,
                    capture_output=True, text=True)
                if args.sass:
                    registers, found = _disassemble(dump, args.cuda_root, args.sass)
                    loops.append((case, kernel, found))
                else:
                    registers = _registers(out.stdout + out.stderr)
                counts.append(registers)
            print(f"| {case} | " + " | ".join(counts) + " |", flush=True)
        for case, kernel, found in loops:
            print(f"\n{case} {kernel}: SASS loops of 20+ instructions")
            for label, length, ops in found:
                print(f"  {label}: {length} instructions; "
                      + ", ".join(f"{op} {n}" for op, n in ops))


if __name__ == "__main__":
    main()
