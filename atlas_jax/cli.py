"""The ``atlas-jax`` command."""

from __future__ import annotations

import argparse
import sys


def _quantize(args: argparse.Namespace) -> int:
    from atlas_jax.quantize_checkpoint import quantize_checkpoint

    dst = quantize_checkpoint(args.src, args.dst, args.format, shared=args.shared,
                              progress=not args.quiet)
    print(f"wrote {dst}")
    return 0


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
