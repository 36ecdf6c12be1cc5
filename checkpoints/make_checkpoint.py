"""The small Qwen3-MoE checkpoint shipped in ``checkpoints/``, its golden outputs, and its NVFP4
version.

Runs in a side virtual environment with torch + transformers (not atlas_jax's own environment);
the NVFP4 version is written by atlas_jax's own ``atlas-jax quantize`` command, run with the
interpreter of atlas_jax's environment (``--atlas-python``)::

    python3.11 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch transformers safetensors numpy
    /tmp/hfvenv/bin/python checkpoints/make_checkpoint.py --atlas-python .venv/bin/python

Writes, next to this script:

* ``qwen3-moe-tiny/``: ``config.json`` + ``model.safetensors`` (``save_pretrained``, BF16 on
  disk) + ``generation_config.json`` + ``goldens.npz`` + ``README.md``. A random Qwen3-MoE:
  4 layers, hidden 256, 4 query heads / 2 kv heads of head_dim 64 with QK-norm, layer 0 a
  dense MLP (``mlp_only_layers=[0]``, intermediate 256), layers 1-3 MoE with 16 experts, top-4,
  ``moe_intermediate_size=64`` (a multiple of 32: NVFP4 and MXFP4 blocks divide it), renormalised
  top-k, vocab 512, untied lm_head.
* ``qwen3-moe-tiny-nvfp4/``: the same model with its routed experts in ModelOpt NVFP4, written
  by ``atlas-jax quantize qwen3-moe-tiny qwen3-moe-tiny-nvfp4 --format nvfp4``.

``goldens.npz`` (transformers run in float32 on the BF16 weights upcast exactly to float32):

    prompt_{i}  [S_i] int32      the fixed prompts (i = 0..2, S = 5, 11, 23)
    logits_{i}  [S_i, V] f32     ``model(prompt_i[None]).logits[0]``
    tokens_{i}  [N] int32        ``model.generate(prompt_i[None], max_new_tokens=N,
                                 do_sample=False)`` new tokens (N = 16, EOS never stops it)
    margin_{i}  [N] f32          top-1 minus top-2 logit at each greedy step (how robust the
                                 greedy choice is to numerical noise)

Why the sizes: ``moe_intermediate_size`` is 64, not 128, to keep the directory under 8 MB
(3 MoE layers x 16 experts x 3 x 64 x 256 = 2.4 M expert parameters; 3.6 M parameters in all,
7.2 MB in BF16).

Random weights: matrices N(0, 1/fan_in) (embedding N(0, 1)), norm weights 1 + N(0, 0.25^2). With
transformers' own init (std 0.02) every layer's contribution is tiny next to the embedding, the
logits are nearly flat and greedy decoding repeats one token; with these scales each layer
matters. ``check_goldens`` asserts it: logits not flat, every greedy sequence has at least 6
distinct tokens, and every greedy step's top-1/top-2 margin is far above float32 noise.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3MoeConfig

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE / "goldens"))
hf = importlib.import_module("_hf")  # checkpoints/goldens/_hf.py, shared with the golden scripts
NAME = "qwen3-moe-tiny"
SEED = 20261201
NEW_TOKENS = 16
PROMPT_LENGTHS = (5, 11, 23)  # 23 > one KV page (16 tokens)
MAX_DIR_BYTES = 8 * 1024 * 1024

CONFIG = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=256,  # the dense MLP of mlp_only_layers
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    moe_intermediate_size=64,
    num_experts=16,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[0],
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def build_model() -> torch.nn.Module:
    config = Qwen3MoeConfig(**CONFIG, attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(config).float().eval()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.is_floating_point():  # the only vectors are RMSNorm weights (no biases)
                hf.randomize_tensor_(name, t, gen)
    return model


def prompts() -> list[np.ndarray]:
    rng = np.random.default_rng(SEED)
    # ids 3.. (0 pad, 1 bos, 2 eos kept out of the prompts)
    return [rng.integers(3, CONFIG["vocab_size"], size=s).astype(np.int32)
            for s in PROMPT_LENGTHS]


@torch.no_grad()
def goldens(model) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    # EOS must not stop generation: atlas_jax's generate always returns max_new_tokens tokens.
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                               pad_token_id=0, bos_token_id=1)
    for i, p in enumerate(prompts()):
        ids = torch.from_numpy(p.astype(np.int64))[None]
        logits = model(ids).logits[0].float()  # [S, V]
        seq = model.generate(ids, generation_config=gen_cfg)
        tokens = seq[0, ids.shape[1]:]
        assert tokens.shape == (NEW_TOKENS,), tokens.shape
        # Cross-check with argmax over full forwards (no KV cache), and record the margins.
        cur = ids
        margins = []
        for t in tokens:
            last = model(cur).logits[0, -1].float()
            top2 = torch.topk(last, 2).values
            margins.append(float(top2[0] - top2[1]))
            assert int(last.argmax()) == int(t), (i, int(last.argmax()), int(t))
            cur = torch.cat([cur, t.view(1, 1)], dim=1)
        out[f"prompt_{i}"] = p
        out[f"logits_{i}"] = logits.numpy().astype(np.float32)
        out[f"tokens_{i}"] = tokens.numpy().astype(np.int32)
        out[f"margin_{i}"] = np.asarray(margins, np.float32)
    return out


def check_goldens(g: dict[str, np.ndarray]) -> list[str]:
    """Random-weight models easily degenerate (flat logits, one token repeated): refuse that."""
    lines = []
    for i in range(len(PROMPT_LENGTHS)):
        logits, tokens, margin = g[f"logits_{i}"], g[f"tokens_{i}"], g[f"margin_{i}"]
        std = float(logits.std(axis=-1).mean())
        distinct = len(set(tokens.tolist()))
        assert std > 0.5, f"prompt {i}: logits nearly flat (std {std:.3f})"
        assert distinct >= 6, f"prompt {i}: greedy tokens degenerate: {tokens.tolist()}"
        assert margin.min() > 1e-3, f"prompt {i}: greedy margin {margin.min():.2e} too small"
        lines.append(f"prompt {i} (S={len(g[f'prompt_{i}'])}): logits std {std:.2f}, "
                     f"{distinct} distinct of {len(tokens)} greedy tokens, min top-1/top-2 "
                     f"margin {margin.min():.3f}; tokens {tokens.tolist()}")
    return lines


def write_readme(path: Path, lines: list[str]) -> None:
    text = f"""# {NAME}

A random Qwen3-MoE made by `checkpoints/make_checkpoint.py` (transformers
{transformers.__version__}, torch {torch.__version__}, seed {SEED}). Weights are random: the
tokens mean nothing; the model exists to test atlas_jax end to end against transformers.

4 layers, hidden 256, 4 query / 2 kv heads, head_dim 64, QK-norm, layer 0 dense
(`mlp_only_layers=[0]`), layers 1-3 MoE (16 experts, top-4, moe_intermediate_size 64,
norm_topk_prob), vocab 512, untied lm_head. BF16 on disk.

`goldens.npz`: transformers' float32 logits and greedy tokens ({NEW_TOKENS} new, EOS ignored)
for three fixed prompts (lengths {", ".join(map(str, PROMPT_LENGTHS))}); the script's checks:

""" + "\n".join(f"- {line}" for line in lines) + "\n"
    (path / "README.md").write_text(text)


NVFP4_README = f"""# {NAME}-nvfp4

`{NAME}` with its routed experts in NVIDIA ModelOpt NVFP4 (E2M1 values, E4M3 scale per 16,
float32 global per linear; weights only, W4A16), written by atlas_jax's own command:

    atlas-jax quantize checkpoints/{NAME} checkpoints/{NAME}-nvfp4 --format nvfp4

Attention, routers, the dense MLP of layer 0, norms, embedding and lm_head are copied unchanged
(BF16). Made by `checkpoints/make_checkpoint.py`; `tests/test_models.py` states the greedy
tokens it gives for the golden prompts and how many agree with the BF16 model's.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=HERE, help="folder for the two checkpoints")
    ap.add_argument("--atlas-python", default=str(REPO / ".venv" / "bin" / "python"),
                    help="Python of atlas_jax's environment, runs `atlas_jax.cli quantize`")
    args = ap.parse_args()
    torch.manual_seed(SEED)
    dst = args.out / NAME
    nvfp4 = args.out / f"{NAME}-nvfp4"
    for d in (dst, nvfp4):
        hf.remove_dir(d)

    model = build_model()
    model.to(torch.bfloat16).save_pretrained(dst)
    # The goldens come from the files on disk: BF16 weights upcast exactly to float32.
    model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    config = json.loads((dst / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["dtype"] == "bfloat16", config
    g = goldens(model)
    lines = check_goldens(g)
    hf.save_npz(dst / "goldens.npz", g)
    write_readme(dst, lines)

    subprocess.run([args.atlas_python, "-m", "atlas_jax.cli", "quantize", str(dst), str(nvfp4),
                    "--format", "nvfp4", "--quiet"], check=True, cwd=REPO)
    (nvfp4 / "README.md").write_text(NVFP4_README)
    for d in (dst, nvfp4):
        size = hf.dir_bytes(d)
        assert size < MAX_DIR_BYTES, f"{d}: {size} bytes, over {MAX_DIR_BYTES}"
        print(f"{d.relative_to(REPO) if d.is_relative_to(REPO) else d}: {size / 2**20:.2f} MiB")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
