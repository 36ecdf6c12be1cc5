"""Golden MoE-block fixtures on QUANTIZED checkpoints, dequantized by Hugging Face transformers.

Runs in the side virtual environment of make_moe_goldens.py (torch + transformers + safetensors)
and calls atlas_jax's own ``quantize`` command in atlas_jax's environment::

    /tmp/hfvenv/bin/python checkpoints/goldens/make_quantized_goldens.py \\
        --out tests/fixtures/moe_quantized --atlas-python /tmp/venv312/bin/python

For every fixture it

1. builds a tiny random float32 model with make_moe_goldens' helpers (``build_model``,
   ``randomize_``) and ``save_pretrained``s it into a temporary folder,
2. quantizes it with ``python -m atlas_jax.cli quantize SRC OUT/<name> --format F`` (OUR writer;
   ``config.json`` + ``model.safetensors`` in ``OUT/<name>`` are exactly what it wrote),
3. loads ``OUT/<name>`` with transformers' own quantizer in dequantize mode
   (``Mxfp4Config(dequantize=True)`` / ``FineGrainedFP8Config(dequantize=True)``) in float32,
4. runs one MoE block (``make_moe_goldens.run_block``) on a random ``x [7, H]`` and stores
   ``golden.npz``: the arrays of the unquantized goldens (x, y, layer, router_logits,
   expert_ids, weights, y_routed) plus ``y_float``, the same block of the float model before
   quantization (so a test can see that the quantization error is far above its tolerance).

Before writing a golden it checks that transformers really dequantized our tensors: every expert
weight transformers loaded differs from the float original by no more than the format's rounding
error, and not at all where the format is exact. ``README.md`` in the output folder is written
by this script.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

sys.path.insert(0, str(Path(__file__).resolve().parent))
hf = importlib.import_module("_hf")
mg = importlib.import_module("make_moe_goldens")

REPO = Path(__file__).resolve().parents[2]
DEFAULT_ATLAS_PYTHON = "/tmp/venv312/bin/python"


@dataclasses.dataclass(frozen=True)
class QFixture:
    fx: Any  # make_moe_goldens.Fixture of the float model
    fmt: str  # atlas-jax quantize --format
    shared: bool = False  # atlas-jax quantize --shared

    @property
    def name(self) -> str:
        return self.fx.name


def _base(name: str):
    return next(f for f in mg.FIXTURES if f.name == name)


def _variant(base: str, name: str, highlights: str, seed_salt: int = 0, **config):
    fx = _base(base)
    return dataclasses.replace(fx, name=name, config={**fx.config, **config},
                               highlights=highlights, seed_salt=seed_salt)


QFIXTURES: list[QFixture] = [
    # MXFP4 blocks are 32 wide along K: gate_up has K = H = 64, down K = I = 64 (2 blocks each).
    QFixture(
        _variant(
            "gpt_oss", "gpt_oss_mxfp4",
            "gpt-oss MXFP4 (experts.{gate_up,down}_proj_{blocks,scales}), E=8 k=2 H=64 I=64, "
            "router bias, interleaved gate/up, float32 expert biases, swiglu_limit=1.5",
            intermediate_size=64,
        ),
        "mxfp4",
    ),
    # FP8 128x128 blocks. H=256 gives two K blocks for gate/up and two N blocks for down;
    # I=16 is one partial block (transformers infers the block from the grid: 16 rows / 1).
    QFixture(
        _variant(
            "deepseek_v3_nonorm", "deepseek_v3_fp8",
            "DeepSeek-V3 FP8 block [128, 128] (weight F8_E4M3 + weight_scale_inv), routed AND "
            "shared experts quantized (--shared), E=8 k=3 H=256 (2 blocks) I=16 (one partial "
            "block: our loader re-blocks gate_up exactly), 1 shared expert, n_group=4 "
            "topk_group=2, norm_topk_prob=true, routed_scaling_factor=2.5",
            hidden_size=256,
            vocab_size=32,
            moe_intermediate_size=16,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        ),
        "fp8",
        shared=True,
    ),
    # I = 128: gate and up are whole 128-row blocks, so gate_up [2I, H] needs no re-blocking.
    QFixture(
        _variant(
            "qwen3_moe_norm", "qwen3_moe_fp8",
            "Qwen3-MoE FP8 block [128, 128] (the Qwen3-*-FP8 layout), E=4 k=2 H=128 I=128 "
            "(whole blocks), norm_topk_prob=true, layer 0 dense (float), layer 1 MoE",
            hidden_size=128,
            vocab_size=32,
            moe_intermediate_size=128,
            intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
        ),
        "fp8",
    ),
]

DEQUANT_CONFIG = {
    "mxfp4": lambda: Mxfp4Config(dequantize=True),
    "fp8": lambda: FineGrainedFP8Config(dequantize=True),
}
# Largest rounding error of one element relative to its block's max |w|: FP8 E4M3 has 3 mantissa
# bits (half an ulp is at most 2^-4 of the value); MXFP4 (atlas_jax's floor(log2 amax) - 2
# exponent) rounds to 2^e * {0, 0.5, .. 6} with the block max in [4, 8) * 2^e, so saturation
# (6 for up to 8) costs at most 1/4 of the block max.
_MAX_ERR = {"fp8": 2.0**-4, "mxfp4": 0.25}


def _quantize(atlas_python: str, src: Path, dst: Path, fmt: str, shared: bool) -> None:
    cmd = [atlas_python, "-m", "atlas_jax.cli", "quantize", str(src), str(dst), "--format", fmt,
           "--quiet"]
    if shared:
        cmd.append("--shared")
    print("  $", " ".join(cmd))
    subprocess.run(cmd, check=True, cwd=REPO)
    for f in dst.iterdir():
        f.chmod(0o644)


def _expert_weights(model, qfx: QFixture, layer: int) -> dict[str, torch.Tensor]:
    """The quantized tensors of one layer as transformers holds them (float, after loading)."""
    mlp = mg._decoder_layers(model)[layer].mlp
    out = {f"experts.{n}": getattr(mlp.experts, n).detach() for n in ("gate_up_proj", "down_proj")}
    if qfx.shared:
        for name, p in mlp.shared_experts.named_parameters():
            out[f"shared_experts.{name}"] = p.detach()
    return out


def _check_dequantized(qfx: QFixture, float_w, deq_w) -> list[str]:
    """transformers' dequantized weights must be the float weights up to the format's rounding."""
    notes = []
    for name, w in float_w.items():
        d = deq_w[name]
        assert d.shape == w.shape and d.dtype == torch.float32, (name, d.shape, d.dtype)
        rel = float((d - w).norm() / w.norm())
        # Per expert (per matrix): no element is off by more than the bound times the largest
        # |w| (which bounds every block's max).
        worst = float(((d - w).abs().amax((-2, -1)) / w.abs().amax((-2, -1))).max())
        assert rel > 0 and worst <= _MAX_ERR[qfx.fmt], (name, rel, worst)
        notes.append(f"{name}: transformers' dequantized weight vs float: rel. error {rel:.2%}")
    return notes


def make_fixture(qfx: QFixture, out_root: Path, atlas_python: str) -> dict[str, Any]:
    fx = qfx.fx
    gen = hf.seeded(mg._seed(fx))
    model = mg.build_model(fx)
    mg.randomize_(model, gen, fx)
    (layer,) = fx.layers

    out_dir = out_root / fx.name
    hf.remove_dir(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "float"
        hf.save_checkpoint(model, src)
        _quantize(atlas_python, src, out_dir, qfx.fmt, qfx.shared)

    quant_cfg = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    loaded = hf.load_float32(AutoModelForCausalLM, out_dir,
                             quantization_config=DEQUANT_CONFIG[qfx.fmt]())
    notes = _check_dequantized(qfx, _expert_weights(model, qfx, layer),
                               _expert_weights(loaded, qfx, layer))

    x = torch.randn(mg.T, model.config.hidden_size, generator=gen)
    token_ids = torch.randint(0, model.config.vocab_size, (mg.T,), generator=gen)
    with torch.no_grad():
        out = mg.run_block(loaded, fx, layer, x, token_ids)
        ref = mg.run_block(model, fx, layer, x, token_ids)
    arrays = hf.to_numpy(out)
    arrays["x"] = x.numpy().astype(np.float32)
    arrays["layer"] = np.asarray(layer, dtype=np.int64)
    arrays["y_float"] = ref["y"].numpy().astype(np.float32)
    hf.save_npz(out_dir / "golden.npz", arrays)

    q_err = float(np.linalg.norm(arrays["y"] - arrays["y_float"]) / np.linalg.norm(arrays["y"]))
    same = bool((np.sort(arrays["expert_ids"], 1) == np.sort(ref["expert_ids"].numpy(), 1)).all())
    notes.append(f"y vs y_float (the block before quantization): rel. error {q_err:.2%}")
    notes.append("routing identical to the float model" if same else "routing differs from float")
    notes += mg._diagnostics(loaded, fx, layer, x, arrays)
    return {"name": fx.name, "model_type": fx.model_type, "fmt": qfx.fmt, "layer": layer,
            "quant_method": quant_cfg["quant_method"],
            "size_kb": round(hf.dir_bytes(out_dir) / 1024),
            "highlights": fx.highlights, "notes": notes}


def write_readme(out_root: Path, summaries: list[dict[str, Any]]) -> None:
    lines = [
        *hf.readme_head(
            "MoE golden fixtures on quantized checkpoints (transformers dequantizes)",
            "/tmp/hfvenv/bin/python checkpoints/goldens/make_quantized_goldens.py \\",
            "    --out tests/fixtures/moe_quantized --atlas-python /tmp/venv312/bin/python",
        ),
        "Each folder is a tiny random float32 model (made with `make_moe_goldens.py`'s helpers) "
        "quantized by atlas_jax's own command, `python -m atlas_jax.cli quantize SRC DST "
        "--format mxfp4|fp8 [--shared]`: `config.json` + `model.safetensors` are exactly what "
        "it wrote (everything but the experts stays float32). transformers then loads the folder "
        "with its own quantizer in dequantize mode (`Mxfp4Config(dequantize=True)` for "
        "`quant_method: mxfp4`, `FineGrainedFP8Config(dequantize=True)` for `quant_method: fp8`, "
        "`dtype=float32`) and runs one MoE block on a random `x [7, H]`.",
        "",
        "`golden.npz` has the arrays of `tests/fixtures/moe` (`x`, `y` = block output, shared "
        "experts included, `layer`, `router_logits`, `expert_ids`, `weights`, `y_routed`) plus "
        "`y_float`: the same block of the float model before quantization. Since transformers "
        "dequantizes the very values we stored (FP8: `f32(w) * scale_inv` per block; MXFP4: "
        "`ldexp(e2m1, scale - 127)`, both exact in float32), an implementation that dequantizes "
        "our files correctly matches `y` to float32 round-off, while `y_float` is off by the "
        "quantization error listed below.",
        "",
        *hf.table_head("fixture", "model_type", "quant_method", "layer", "size", "highlights"),
    ]
    for s in summaries:
        lines.append(f"| `{s['name']}` | {s['model_type']} | {s['quant_method']} | {s['layer']} "
                     f"| {s['size_kb']} KB | {s['highlights']} |")
    lines += ["", "Checks recorded when the goldens were made:", ""]
    for s in summaries:
        lines += [f"- `{s['name']}`: {note}" for note in s["notes"]]
    lines += [
        "",
        "transformers behaviours these fixtures rely on (5.24):",
        "",
        "- MXFP4: `Mxfp4Config(dequantize=True)` works on CPU without triton/kernels; "
        "`Mxfp4Dequantize` reads `experts.{gate_up,down}_proj_{blocks,scales}` `[E, N, K/32, 16]` "
        "/ `[E, N, K/32]`, low nibble first, and transposes to gpt-oss's input-major "
        "`[E, K, N]` parameters. Only gpt-oss has an MXFP4 path in transformers.",
        "- FP8: `Fp8Dequantize` infers the block from the scale grid (`rows // scale_rows`, "
        "`cols // scale_cols`) instead of reading `weight_block_size`, and raises when a dim is "
        "not divisible by its grid. A weight whose dims are multiples of 128, or smaller than "
        "128 (one partial block), dequantizes exactly; a dim with a partial edge block "
        "(e.g. 192 = 128 + 64) would be dequantized with the wrong block (192 rows, grid 2: "
        "blocks of 96) or raise (576 rows, grid 5), so the fixtures avoid such dims (real "
        "DeepSeek-V3 / Qwen3 FP8 expert dims are multiples of 128).",
        "- FP8: `FineGrainedFP8HfQuantizer.validate_environment` requires `accelerate` even with "
        "`dequantize=True` (`pip install accelerate` in the side venv). Qwen3-MoE works like "
        "DeepSeek-V3: the dequantize op runs first in the model's per-expert merge converter "
        "(`experts.*.gate_proj.weight` + `weight_scale_inv` -> `experts.gate_up_proj`).",
        "- Both quantizers log that they dequantize \"to bf16\"; with `dtype=float32` the "
        "weights are in fact dequantized to float32 (the dtype of the parameter they load into); "
        "the script asserts it.",
        "",
        "Tested by `tests/test_quantized_goldens.py`.",
        "",
    ]
    (out_root / "README.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = hf.fixture_parser(__doc__, REPO / "tests" / "fixtures" / "moe_quantized")
    parser.add_argument("--atlas-python", default=DEFAULT_ATLAS_PYTHON,
                        help="interpreter of atlas_jax's environment (runs atlas_jax.cli quantize)")
    hf.add_only(parser)
    args = hf.parse_args(parser, argv)
    summaries = []
    for qfx in hf.selected(QFIXTURES, args.only):
        s = make_fixture(qfx, args.out.resolve(), args.atlas_python)
        summaries.append(s)
        print(f"{s['name']:20s} {s['size_kb']:4d} KB")
        for note in s["notes"]:
            print(f"    {note}")
    if not args.only:
        write_readme(args.out, summaries)


if __name__ == "__main__":
    main()
