"""Golden attention-layer fixtures made with Hugging Face transformers.

Runs in a side virtual environment with torch + transformers (see make_moe_goldens.py)::

    /tmp/hfvenv/bin/python checkpoints/goldens/make_attention_goldens.py \\
        --out tests/fixtures/attention

Each fixture is a tiny random float32 model (``config.json`` + ``model.safetensors`` written by
``save_pretrained``) and ``golden.npz`` for the ``self_attn`` module of layer 0, called exactly as
the decoder layer calls it: position embeddings from the model's rotary embedding, the causal
mask from ``create_causal_mask`` (eager attention, no cache):

    x [B, S, H] f32               input to self_attn (i.e. after input_layernorm)
    position_ids [B, S] i32
    cos, sin [B, S, R] f32        what the rotary embedding returned (R = rotated dims,
                                  attention_scaling already multiplied in)
    causal_mask [B, 1, S, S] f32  additive mask (0 / finfo.min)
    q [B, Hq, S, D], k, v [B, Hkv, S, D] f32   after q/k norm and RoPE, before repeat_kv
    attn [B, S, Hq*D] f32         softmax(qk^T * D^-0.5 + mask) v, before any output gate / o_proj
    y [B, S, H] f32               self_attn output (after o_proj)
    rope_cos, rope_sin [P, R] f32 rotary table for positions 0..P-1 (P = max_position_embeddings)
    attention_scaling () f32, layer () i64

The script reloads every fixture with ``from_pretrained`` and recomputes, so the goldens come
from exactly the files on disk.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _hf as hf
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.masking_utils import create_causal_mask

B, S, H = 2, 9, 64

COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": H,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 32,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


@dataclass(frozen=True)
class Fixture:
    name: str
    model_type: str
    config: dict[str, Any]
    highlights: str


FIXTURES = [
    Fixture(
        "qwen3",
        "qwen3",
        dict(
            head_dim=16,
            attention_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        "heads 4 / kv 2, head_dim 16, per-head QK RMSNorm (x*w), neox RoPE theta 1e6, no bias",
    ),
    Fixture(
        "qwen3_yarn",
        "qwen3",
        dict(
            head_dim=16,
            attention_bias=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "as qwen3 + YaRN (factor 4, original_max_position_embeddings 64, "
        "max_position_embeddings 256, attention_factor 0.1*ln(4)+1 on cos/sin) + q/k/v/o biases",
    ),
    Fixture(
        "qwen3_next",
        "qwen3_next",
        dict(
            head_dim=32,
            attention_bias=True,
            layer_types=["full_attention"],
            mlp_only_layers=[0],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=8,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000000.0,
                "partial_rotary_factor": 0.25,
            },
        ),
        "full_attention layer: gated attention (q_proj emits [q_h | gate_h] per head, "
        "attn * sigmoid(gate)), head_dim 32, partial_rotary_factor 0.25 (8 rotated dims), "
        "zero-centred (1+w) QK RMSNorm, q/k/v/o biases",
    ),
]


def build_model(fx: Fixture):
    config = AutoConfig.for_model(fx.model_type, **{**COMMON, **fx.config}, **hf.EAGER)
    return AutoModelForCausalLM.from_config(config).float().eval()


def randomize_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Matrices N(0, 1/fan_in); 1-initialised vectors 1 + N(0, 0.25^2); 0-initialised vectors
    (biases, zero-centred norm weights) N(0, 0.2^2)."""
    with torch.no_grad():
        for name, t in model.named_parameters():
            hf.randomize_tensor_(name, t, gen, zero_std=0.2)


class _Capture:
    """Wraps the modeling module's eager_attention_forward to record q, k, v and the output."""

    def __init__(self, module):
        self.module = module
        self.original = module.eager_attention_forward
        self.seen: dict[str, torch.Tensor] = {}

    def __enter__(self):
        def wrapped(mod, query, key, value, attention_mask, scaling, **kwargs):
            out, weights = self.original(mod, query, key, value, attention_mask, scaling, **kwargs)
            self.seen.update(q=query, k=key, v=value, attn=out.reshape(*out.shape[:2], -1))
            self.seen["scaling"] = torch.tensor(scaling)
            return out, weights

        self.module.eager_attention_forward = wrapped
        return self

    def __exit__(self, *exc):
        self.module.eager_attention_forward = self.original


def run_attention(model, fx: Fixture, x: torch.Tensor, position_ids: torch.Tensor):
    inner = model.model
    cos, sin = inner.rotary_emb(x, position_ids)
    mask = create_causal_mask(
        config=model.config,
        inputs_embeds=x,
        attention_mask=None,
        cache=None,
        position_ids=position_ids,
    )
    if mask is None:
        raise RuntimeError("create_causal_mask returned None; eager attention needs a mask")
    attn = inner.layers[0].self_attn
    modeling = importlib.import_module(type(attn).__module__)
    with _Capture(modeling) as cap:
        y, _ = attn(hidden_states=x, position_embeddings=(cos, sin), attention_mask=mask)
    if not torch.isclose(cap.seen["scaling"], torch.tensor(attn.head_dim**-0.5)):
        raise RuntimeError("unexpected attention scaling")
    table_pos = torch.arange(model.config.max_position_embeddings)[None]
    rope_cos, rope_sin = inner.rotary_emb(x[:1, :1], table_pos)
    return {
        "x": x,
        "position_ids": position_ids,
        "cos": cos,
        "sin": sin,
        "causal_mask": mask,
        "q": cap.seen["q"],
        "k": cap.seen["k"],
        "v": cap.seen["v"],
        "attn": cap.seen["attn"],
        "y": y,
        "rope_cos": rope_cos[0],
        "rope_sin": rope_sin[0],
        "attention_scaling": torch.tensor(inner.rotary_emb.attention_scaling),
    }


def make_fixture(fx: Fixture, out_root: Path) -> dict[str, Any]:
    gen = hf.seeded(hf.name_seed(fx.name))
    model = build_model(fx)
    randomize_(model, gen)
    out_dir = out_root / fx.name
    reloaded = hf.save_and_reload(model, out_dir)
    x = torch.randn(B, S, H, generator=gen)
    position_ids = torch.arange(S)[None].expand(B, S)
    with torch.no_grad():
        out = run_attention(reloaded, fx, x, position_ids)
        ref = run_attention(model, fx, x, position_ids)
    torch.testing.assert_close(out["y"], ref["y"], rtol=0, atol=0)
    arrays = hf.to_numpy(out)
    arrays["layer"] = np.asarray(0, dtype=np.int64)
    hf.save_npz(out_dir / "golden.npz", arrays)
    return {
        "name": fx.name,
        "model_type": fx.model_type,
        "size_kb": round(hf.dir_bytes(out_dir) / 1024),
        "highlights": fx.highlights,
        "rotary_dims": int(arrays["cos"].shape[-1]),
        "attention_scaling": float(arrays["attention_scaling"]),
    }


def write_readme(out_root: Path, summaries: list[dict[str, Any]]) -> None:
    lines = [
        *hf.readme_head(
            "Attention golden fixtures (Hugging Face transformers)",
            "/tmp/hfvenv/bin/python checkpoints/goldens/make_attention_goldens.py "
            "--out tests/fixtures/attention",
        ),
        "Each folder: `config.json` + `model.safetensors` (one decoder layer, float32, hidden 64, "
        "vocab 128, every parameter randomized incl. norm weights and biases) and `golden.npz` "
        "for `model.layers[0].self_attn` called as the decoder layer calls it (eager attention, "
        "causal mask, no cache). Keys: `x [2, 9, 64]`, `position_ids [2, 9]` (0..8), "
        "`cos`/`sin [2, 9, R]`, `causal_mask [2, 1, 9, 9]` (additive), `q [2, Hq, 9, D]`, "
        "`k`/`v [2, Hkv, 9, D]` (after QK-norm + RoPE, before GQA repeat), `attn [2, 9, Hq*D]` "
        "(before output gate / o_proj), `y [2, 9, 64]`, `rope_cos`/`rope_sin [256, R]` (table for "
        "positions 0..255), `attention_scaling`, `layer`.",
        "",
        *hf.table_head(
            "fixture", "model_type", "rotated dims R", "cos/sin scaling", "size", "highlights"
        ),
    ]
    for s in summaries:
        lines.append(
            f"| `{s['name']}` | {s['model_type']} | {s['rotary_dims']} | "
            f"{s['attention_scaling']:.6f} | {s['size_kb']} KB | {s['highlights']} |"
        )
    lines.append("")
    (out_root / "README.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = hf.fixture_parser(__doc__, Path("tests/fixtures/attention"))
    args = hf.parse_args(parser, argv)
    summaries = []
    for fx in FIXTURES:
        s = make_fixture(fx, args.out)
        summaries.append(s)
        print(
            f"{fx.name:12s} {s['size_kb']:4d} KB  R={s['rotary_dims']} "
            f"scaling={s['attention_scaling']:.6f}"
        )
    write_readme(args.out, summaries)


if __name__ == "__main__":
    main()
