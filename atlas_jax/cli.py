"""The ``atlas-jax`` command: ``generate`` (the main job), ``bench``, ``quantize``."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

# The repository root (an editable install points here): the shipped checkpoint and the
# benchmark scripts live beside the package, not inside it.
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT = REPO_ROOT / "checkpoints" / "qwen3-moe-tiny"
BENCHMARKS = {
    "grouped-matmul": "grouped_matmul.py",
    "paged-attention": "paged_attention.py",
    "paged-attention-mosaic": "paged_attention_mosaic.py",
    "autotune-grouped-matmul": "autotune_grouped_matmul.py",
    "grouped-matmul-mosaic": "grouped_matmul_mosaic.py",
    "moe-decode": "moe_decode.py",
    "moe-decode-arms": "moe_decode_arms.py",
    "moe-decode-mosaic": "moe_decode_mosaic.py",
    "moe-decode-plan": "moe_decode_plan.py",
    "moe-parallel": "moe_parallel.py",
    "moe-router": "moe_router.py",
}
KV_DTYPES = {"bf16": "bf16", "fp8": "fp8", "nvfp4": "nvfp4", "float32": "float32"}
DTYPES = ("bf16", "float32")


def _quantize(args: argparse.Namespace) -> int:
    from atlas_jax.quantize_checkpoint import quantize_checkpoint

    dst = quantize_checkpoint(args.src, args.dst, args.format, shared=args.shared,
                              progress=not args.quiet)
    print(f"wrote {dst}")
    return 0


def _prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids like 1,2,3, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _default_prompts(checkpoint: Path) -> list[list[int]]:
    """The first golden prompt of a shipped checkpoint, else a fixed one."""
    import numpy as np

    goldens = checkpoint / "goldens.npz"
    if goldens.is_file():
        return [np.load(goldens)["prompt_0"].tolist()]
    return [[1, 2, 3, 4, 5]]


def _ms(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.2f} ms"


def _golden_agreement(checkpoint: Path, prompt: list[int], new: list[int]) -> str | None:
    """How many of ``new`` equal transformers' greedy tokens, when ``prompt`` is a golden one."""
    import numpy as np

    goldens = checkpoint / "goldens.npz"
    if not goldens.is_file():
        return None
    g = np.load(goldens)
    for key in g.files:
        if key.startswith("prompt_") and g[key].tolist() == prompt:
            ref = g[key.replace("prompt_", "tokens_")].tolist()[:len(new)]
            same = sum(a == b for a, b in zip(new, ref, strict=False))
            return f"{same}/{len(ref)} equal transformers' float32 greedy tokens (goldens.npz)"
    return None


def _generate(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    import atlas_jax as aj

    checkpoint = Path(args.checkpoint) if args.checkpoint else DEFAULT_CHECKPOINT
    if not (checkpoint / "config.json").is_file():
        where = "the shipped checkpoint" if args.checkpoint is None else "--checkpoint"
        raise ValueError(f"{where} {checkpoint} is not an HF model directory (no config.json)"
                         + ("; it ships in the git repository, not in the wheel: pass "
                            "--checkpoint DIR" if args.checkpoint is None else ""))
    prompts = args.prompt_ids or _default_prompts(checkpoint)
    dtype = {"bf16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    model = aj.models.load(checkpoint, kv_dtype=KV_DTYPES[args.kv_dtype], kernels=args.kernels,
                           dtype=dtype, progress=not args.quiet, act_quant=args.act_quant)
    print(f"model: {model}")
    print(f"  {checkpoint}; dtype {args.dtype}, kv {args.kv_dtype}, kernels {args.kernels}, "
          f"act quant {args.act_quant}, "
          f"backend {jax.default_backend()}")
    runs = []
    for _ in range(args.repeat):
        tokens, times = model.generate_timed(prompts, args.max_new_tokens)
        runs.append(times)
    for b, (prompt, new) in enumerate(zip(prompts, tokens.tolist(), strict=True)):
        tag = f"[{b}] " if len(prompts) > 1 else ""
        print(f"{tag}prompt ({len(prompt)} tokens): {','.join(map(str, prompt))}")
        print(f"{tag}new tokens ({len(new)}): {','.join(map(str, new))}")
        agreement = _golden_agreement(checkpoint, prompt, new)
        if agreement:
            print(f"{tag}  {agreement}")
    first, last = runs[0], runs[-1]
    print(f"prefill: {_ms(last.prefill_s)}"
          + (f" (first call, with compilation: {_ms(first.prefill_s)})" if len(runs) > 1 else
             " (first call: includes compilation)"))
    if last.decode_steps:
        print(f"decode: {_ms(last.decode_s_per_token)} / token over {last.decode_steps} steps"
              + (f" (first call, with compilation: {_ms(first.decode_s_per_token)} / token)"
                 if len(runs) > 1 else " (first call: includes compilation)"))
    else:
        print("decode: no decode step (--max-new-tokens 1)")
    return 0


def _bench(args: argparse.Namespace) -> int:
    script = REPO_ROOT / "benchmarks" / BENCHMARKS[args.name]
    if not script.is_file():
        raise ValueError(f"benchmark script {script} not found: the benchmarks ship in the git "
                         "repository (run from a checkout installed with pip install -e .)")
    return subprocess.call([sys.executable, str(script), *args.args])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atlas-jax", description="atlas_jax: JAX/Pallas MoE inference layers.")
    sub = parser.add_subparsers(dest="command", required=True)

    q = sub.add_parser(
        "quantize", help="quantize the expert weights of an HF directory",
        description="Write DST, a loadable HF directory with SRC's expert weights quantized "
                    "(ModelOpt NVFP4, DeepSeek FP8-block or gpt-oss MXFP4 layout); everything "
                    "else is copied unchanged.")
    q.add_argument("src", help="BF16/F32 HF model directory (config.json + *.safetensors)")
    q.add_argument("dst", help="output directory (created; must be empty if it exists)")
    q.add_argument("--format", required=True, choices=["nvfp4", "mxfp4", "fp8"])
    q.add_argument("--shared", action="store_true", help="also quantize the shared expert(s)")
    q.add_argument("--quiet", action="store_true", help="no progress bar")
    q.set_defaults(run=_quantize)

    g = sub.add_parser(
        "generate", help="greedy generation with a checkpoint (default: the shipped tiny one)",
        description="Load an HF Qwen3-MoE directory and generate greedily over a paged KV "
                    "cache; print the new tokens, the prefill time and the per-token decode "
                    "latency. With no arguments: the shipped checkpoints/qwen3-moe-tiny and its "
                    "first golden prompt.")
    g.add_argument("--checkpoint", metavar="DIR",
                   help=f"HF model directory (default: {DEFAULT_CHECKPOINT})")
    g.add_argument("--prompt-ids", type=_prompt_ids, action="append", metavar="IDS",
                   help="comma-separated prompt token ids, e.g. 1,2,3; repeat for a batch of "
                        "prompts (lengths may differ)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=16, metavar="N",
                   help="tokens to generate a prompt (default 16)")
    g.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="bf16",
                   help="KV cache storage (default bf16)")
    g.add_argument("--kernels", choices=["auto", "xla", "pallas"], default="auto",
                   help="implementation of every op: auto = Pallas on GPU, XLA reference "
                        "elsewhere (default auto)")
    g.add_argument("--dtype", choices=list(DTYPES), default="bf16",
                   help="activations and unquantized weights (default bf16)")
    g.add_argument("--act-quant", choices=["none", "fp8"], default="none",
                   help="fp8: run FP8-block experts W8A8 (e4m3 activations per token per "
                        "128, as transformers' FP8 layers on a GPU); needs a checkpoint with "
                        "FP8 experts, e.g. from `atlas-jax quantize --format fp8` (default "
                        "none: weight-only)")
    g.add_argument("--repeat", type=_positive_int, default=2, metavar="R",
                   help="runs; the times printed are the last run's (default 2: the first "
                        "one compiles)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.set_defaults(run=_generate)

    b = sub.add_parser(
        "bench", help="run a benchmark script (needs a GPU)",
        description="Run benchmarks/<script>.py with the remaining arguments (e.g. --quick; "
                    "paged-attention --prefill runs its prefill section alone); "
                    "`atlas-jax bench NAME --help` shows the script's own options.")
    b.add_argument("name", choices=list(BENCHMARKS),
                   help=", ".join(f"{k}: benchmarks/{v}" for k, v in BENCHMARKS.items()))
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    b.set_defaults(run=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, NotImplementedError) as e:
        print(f"atlas-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
