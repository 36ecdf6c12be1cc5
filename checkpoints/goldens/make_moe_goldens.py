"""Golden MoE-block fixtures made with Hugging Face transformers.

Runs in a side virtual environment that has torch + transformers (not in atlas_jax's own
environment), e.g.::

    python3 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch transformers safetensors numpy
    /tmp/hfvenv/bin/python checkpoints/goldens/make_moe_goldens.py --out tests/fixtures/moe

For every fixture it builds a tiny random float32 model from the model type's configuration
class, randomizes all parameters (including the ones HF initialises to 0 or 1: biases,
e_score_correction_bias, norm weights, router scales), writes ``config.json`` +
``model.safetensors`` with ``save_pretrained`` (HF's checkpoint key layout), then feeds a random
``x [T, H]`` through one MoE block module directly and stores ``golden.npz``:

    x [T, H] f32, y [T, H] f32, layer () i64,
    router_logits [T, E(+Z)] f32 (gemma4: router_probs, already softmaxed),
    expert_ids [T, k] i32 and weights [T, k] f32 in HF's order (top-k with sorted=False in some
    routers: compare as sets or sort by id),
    y_routed [T, H] f32 (routed experts only, before any shared expert),
    token_ids [T] i32 (deepseek_v4 hash routing only),
    gemma4 also: y_moe, y_dense (see ``_gemma4_block``).

Every fixture is reloaded with ``from_pretrained`` and recomputed, so the files on disk are
exactly what produced the goldens. ``README.md`` in the output folder is written by this script.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _hf as hf
import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

T = 7  # tokens per golden input
H = 64  # hidden size of every fixture
VOCAB = 128

# Keys every fixture shares. Attention is kept tiny (head_dim 8) so that the MoE weights
# dominate the file size; the attention fixtures live in make_attention_goldens.py.
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": H,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
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
    layers: tuple[int, ...]  # MoE layers to write goldens for; the first one is golden.npz
    highlights: str
    bias_std: float = 0.1  # std of e_score_correction_bias (selection-only bias)
    seed_salt: int = 0  # bump to re-draw the random parameters and inputs
    extra: dict[str, Any] = field(default_factory=dict)


FIXTURES: list[Fixture] = [
    Fixture(
        "qwen3_moe_norm",
        "qwen3_moe",
        dict(
            num_hidden_layers=2,
            head_dim=8,
            intermediate_size=32,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            decoder_sparse_step=1,
        ),
        (1,),
        "E=8 k=2 I=16, norm_topk_prob=true, mlp_only_layers=[0] (layer 0 dense, layer 1 MoE)",
    ),
    Fixture(
        "qwen3_moe_nonorm",
        "qwen3_moe",
        dict(
            num_hidden_layers=1,
            head_dim=8,
            intermediate_size=32,
            moe_intermediate_size=8,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            mlp_only_layers=[],
        ),
        (0,),
        "E=16 k=4 I=8, norm_topk_prob=false (weights are plain softmax probs)",
    ),
    Fixture(
        "qwen2_moe_nonorm",
        "qwen2_moe",
        dict(
            num_hidden_layers=2,
            head_dim=8,
            intermediate_size=32,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            qkv_bias=True,
        ),
        (1,),
        "E=8 k=2 I=16, shared expert I=32 + sigmoid shared_expert_gate, norm_topk_prob=false, "
        "decoder_sparse_step=2 (layer 0 dense, layer 1 MoE)",
    ),
    Fixture(
        "qwen2_moe_norm",
        "qwen2_moe",
        dict(
            num_hidden_layers=1,
            head_dim=8,
            intermediate_size=32,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=8,
            num_experts_per_tok=4,
            norm_topk_prob=True,
        ),
        (0,),
        "E=8 k=4 I=16, shared expert I=24 + gate, norm_topk_prob=true",
    ),
    Fixture(
        "mixtral",
        "mixtral",
        dict(
            num_hidden_layers=1,
            head_dim=8,
            intermediate_size=16,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
        (0,),
        "E=8 k=2 I=16 (intermediate_size is the expert width), always renormalised",
    ),
    Fixture(
        "deepseek_v3_norm",
        "deepseek_v3",
        dict(
            num_hidden_layers=2,
            intermediate_size=32,
            moe_intermediate_size=16,
            n_routed_experts=8,
            n_shared_experts=2,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
        ),
        (1,),
        "E=8 k=3 I=16, sigmoid + e_score_correction_bias, n_group=4 topk_group=2, "
        "2 shared experts (I=32), norm_topk_prob=true, routed_scaling_factor=2.5, "
        "first_k_dense_replace=1",
    ),
    Fixture(
        "deepseek_v3_nonorm",
        "deepseek_v3",
        dict(
            num_hidden_layers=1,
            intermediate_size=32,
            moe_intermediate_size=8,
            n_routed_experts=16,
            n_shared_experts=1,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=0,
            norm_topk_prob=False,
            routed_scaling_factor=1.75,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
        ),
        (0,),
        "E=16 k=4 I=8, sigmoid + bias, n_group=4 topk_group=2, 1 shared expert, "
        "norm_topk_prob=false, routed_scaling_factor=1.75",
    ),
    Fixture(
        "gpt_oss",
        "gpt_oss",
        dict(
            num_hidden_layers=1,
            head_dim=8,
            intermediate_size=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            swiglu_limit=1.5,
            sliding_window=4,
            layer_types=["full_attention"],
            attention_bias=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        ),
        (0,),
        "E=8 k=2 I=16, router bias, top-k on logits then softmax, interleaved gate/up "
        "[E,H,2I], expert biases, swiglu_limit=1.5 (real: 7.0; lowered so clamps fire), "
        "alpha=1.702",
    ),
    Fixture(
        "qwen3_next_norm",
        "qwen3_next",
        dict(
            num_hidden_layers=2,
            head_dim=8,
            intermediate_size=32,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            layer_types=["linear_attention", "full_attention"],
            mlp_only_layers=[0],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        ),
        (1,),
        "E=8 k=2 I=16, shared expert I=32 + gate, norm_topk_prob=true, "
        "layer_types=[linear_attention, full_attention], mlp_only_layers=[0]",
    ),
    Fixture(
        "qwen3_next_nonorm",
        "qwen3_next",
        dict(
            num_hidden_layers=1,
            head_dim=8,
            intermediate_size=32,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=16,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            layer_types=["full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
        ),
        (0,),
        "E=16 k=4 I=8, shared expert I=16 + gate, norm_topk_prob=false",
    ),
    Fixture(
        "longcat_flash",
        "longcat_flash",
        dict(
            num_layers=1,
            ffn_hidden_size=16,
            expert_ffn_hidden_size=16,
            n_routed_experts=8,
            zero_expert_num=4,
            moe_topk=3,
            routed_scaling_factor=2.0,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            head_dim=8,
        ),
        (0,),
        "8 routed + 4 zero (identity) experts, k=3 I=16, softmax over 12 + selection-only "
        "e_score_correction_bias, no renorm, routed_scaling_factor=2.0 (real: 6.0)",
        bias_std=0.02,
        seed_salt=4,
    ),
    Fixture(
        "minimax_m2",
        "minimax_m2",
        dict(
            num_hidden_layers=1,
            head_dim=16,
            intermediate_size=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            rotary_dim=8,
        ),
        (0,),
        "E=8 k=2 I=16, sigmoid + selection-only e_score_correction_bias (on the block), "
        "always renormalised, no scaling",
    ),
    Fixture(
        "deepseek_v4",
        "deepseek_v4",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=1,
            head_dim=16,
            moe_intermediate_size=8,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            q_lora_rank=8,
            o_groups=2,
            o_lora_rank=8,
            index_n_heads=2,
            index_head_dim=8,
            index_topk=4,
            sliding_window=4,
            layer_types=["sliding_attention", "sliding_attention"],
            mlp_layer_types=["hash_moe", "moe"],
            swiglu_limit=1.5,
            routed_scaling_factor=2.0,
            scoring_func="sqrtsoftplus",
            hc_mult=2,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        ),
        (0, 1),
        "E=8 k=2 I=8, sqrt(softplus) scores, layer 0 hash_moe (tid2eid[token_ids]), layer 1 moe "
        "(+ e_score_correction_bias), always renormalised (eps 1e-20), routed_scaling_factor=2.0, "
        "swiglu_limit=1.5 on routed AND shared experts (real: 10.0)",
    ),
    Fixture(
        "gemma4",
        "gemma4",
        dict(
            num_hidden_layers=1,
            intermediate_size=32,
            head_dim=8,
            global_head_dim=16,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            layer_types=["full_attention"],
            sliding_window=8,
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=VOCAB,
            enable_moe_block=True,
            num_experts=8,
            top_k_experts=2,
            moe_intermediate_size=16,
            final_logit_softcapping=30.0,
        ),
        (0,),
        "Gemma4ForConditionalGeneration (text_config only), E=8 k=2 I=16, dense MLP + MoE in "
        "parallel, router RMSNorm(no scale)*scale*H^-0.5, per_expert_scale, GeGLU (gelu tanh)",
    ),
]


# ----------------------------------------------------------------------------- model building


def _seed(fx: Fixture) -> int:
    return hf.name_seed(fx.name, fx.seed_salt)


def build_config(fx: Fixture):
    if fx.model_type == "gemma4":
        text = {**COMMON, **fx.config}
        return transformers.Gemma4Config(
            text_config=text,
            vision_config=None,
            audio_config=None,
            tie_word_embeddings=True,
            **hf.EAGER,
        )
    return AutoConfig.for_model(fx.model_type, **{**COMMON, **fx.config}, **hf.EAGER)


def build_model(fx: Fixture):
    config = build_config(fx)
    if fx.model_type == "gemma4":
        model = transformers.Gemma4ForConditionalGeneration(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    return model.float().eval()


def randomize_(model: torch.nn.Module, gen: torch.Generator, fx: Fixture) -> None:
    """Give every persistent parameter/buffer a non-trivial random value.

    Matrices get N(0, 1/fan_in) so activations stay O(1); vectors that HF initialises to one
    (norm weights, router scales) get 1 + N(0, 0.25^2); vectors initialised to zero (biases,
    zero-centred (1+w) norm weights, sinks) get N(0, 0.1^2) (e_score_correction_bias:
    ``fx.bias_std``); tid2eid gets k distinct random experts per token.
    """
    persistent = set(model.state_dict().keys())
    tensors = dict(model.named_parameters())
    tensors.update({k: v for k, v in model.named_buffers() if k in persistent})
    with torch.no_grad():
        for name, t in tensors.items():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "tid2eid":
                rows = [
                    torch.randperm(fx.config["n_routed_experts"], generator=gen)[: t.shape[1]]
                    for _ in range(t.shape[0])
                ]
                t.copy_(torch.stack(rows).to(t.dtype))
                continue
            if not t.is_floating_point():
                continue
            if leaf == "layer_scalar":  # multiplies the whole residual stream; keep it at 1
                continue
            if leaf == "e_score_correction_bias":
                t.copy_(torch.randn(t.shape, generator=gen) * fx.bias_std)
                continue
            # gpt-oss stores experts transposed ([E, in, out]); everything else is [.., out, in]
            transposed = fx.model_type == "gpt_oss" and leaf in ("gate_up_proj", "down_proj")
            hf.randomize_tensor_(name, t, gen, zero_std=0.1,
                                 fan_in=t.shape[-2] if transposed else None)


# ----------------------------------------------------------------------------- running a block


def _decoder_layers(model) -> torch.nn.ModuleList:
    inner = model.model
    return inner.language_model.layers if hasattr(inner, "language_model") else inner.layers


def _gemma4_block(layer, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The FFN half of Gemma4TextDecoderLayer (after ``residual = hidden_states``).

    x is the residual stream entering the FFN half. Returns
      y        = post_feedforward_layernorm(y_dense + y_moe)   (the layer adds x to this)
      y_dense  = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(x)))
      y_moe    = post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(x), router(x)))
      y_routed = experts(...) before post_feedforward_layernorm_2
    """
    dense = layer.post_feedforward_layernorm_1(layer.mlp(layer.pre_feedforward_layernorm(x)))
    probs, weights, ids = layer.router(x)
    routed = layer.experts(layer.pre_feedforward_layernorm_2(x), ids, weights)
    moe = layer.post_feedforward_layernorm_2(routed)
    y = layer.post_feedforward_layernorm(dense + moe)
    return {
        "y": y,
        "y_dense": dense,
        "y_moe": moe,
        "y_routed": routed,
        "router_probs": probs,
        "expert_ids": ids,
        "weights": weights,
    }


def _check_gemma4_decomposition(layer, x: torch.Tensor, y: torch.Tensor) -> None:
    """Run the real decoder layer with attention zeroed: it must return x + y."""

    class _ZeroAttn(torch.nn.Module):
        def forward(self, hidden_states, **kwargs):
            return torch.zeros_like(hidden_states), None

    real = layer.self_attn
    layer.self_attn = _ZeroAttn()
    try:
        out = layer(x[None], position_embeddings=None, attention_mask=None, shared_kv_states={})
    finally:
        layer.self_attn = real
    torch.testing.assert_close(out[0], (x + y) * layer.layer_scalar, rtol=1e-5, atol=1e-5)


def run_block(model, fx: Fixture, layer_idx: int, x: torch.Tensor, token_ids: torch.Tensor):
    """Feed x [T, H] through the MoE block of ``layer_idx``; return the golden arrays."""
    layer = _decoder_layers(model)[layer_idx]
    mt = fx.model_type
    if mt == "gemma4":
        out = _gemma4_block(layer, x)
        _check_gemma4_decomposition(layer, x, out["y"])
        return out
    block = layer.mlp
    x3 = x[None]  # HF blocks take [B, S, H]
    out: dict[str, torch.Tensor] = {}
    if mt == "gpt_oss":
        logits, weights, ids = block.router(x)
        out["y"] = block(x3)[0][0]
    elif mt == "minimax_m2":
        logits, weights, ids = block.gate(x, block.e_score_correction_bias)
        out["y"] = block(x3)[0]
    elif mt == "longcat_flash":
        logits, weights, ids = block.router(x)
        out["y"] = block(x3)[0]
    elif mt == "deepseek_v4":
        if block.is_hash:
            logits, weights, ids = block.gate(x3, token_ids[None])
            out["token_ids"] = token_ids
        else:
            logits, weights, ids = block.gate(x3)
        out["y"] = block(x3, input_ids=token_ids[None])[0]
    else:  # qwen3_moe, qwen2_moe, qwen3_next, mixtral, deepseek_v3: router is block.gate
        logits, weights, ids = block.gate(x)
        out["y"] = block(x3)[0]
    out["y_routed"] = block.experts(x, ids, weights)
    out.update(router_logits=logits, expert_ids=ids, weights=weights)
    return out


# ----------------------------------------------------------------------------- diagnostics


def _diagnostics(model, fx: Fixture, layer_idx: int, x: torch.Tensor, arrays) -> list[str]:
    """Facts that show the fixture exercises its special feature (printed and put in README)."""
    notes = []
    ids = arrays["expert_ids"]
    if fx.model_type == "longcat_flash":
        n_zero = int((ids >= fx.config["n_routed_experts"]).sum())
        notes.append(f"{n_zero}/{ids.size} selections hit zero experts")
        assert n_zero >= 3, "too few zero experts selected; change seed_salt"
    if fx.model_type == "gpt_oss":
        block = _decoder_layers(model)[layer_idx].mlp.experts
        gate_up = torch.einsum("th,ehn->ten", x, block.gate_up_proj) + block.gate_up_proj_bias
        frac = float((gate_up.abs() > fx.config["swiglu_limit"]).float().mean())
        notes.append(f"{frac:.0%} of gate/up pre-activations exceed swiglu_limit")
    if fx.model_type == "deepseek_v4":
        block = _decoder_layers(model)[layer_idx].mlp.experts
        gate_up = torch.einsum("th,enh->ten", x, block.gate_up_proj)
        frac = float((gate_up.abs() > fx.config["swiglu_limit"]).float().mean())
        notes.append(f"{frac:.0%} of routed gate/up pre-activations exceed swiglu_limit")
    if fx.model_type == "deepseek_v3":
        gate = _decoder_layers(model)[layer_idx].mlp.gate
        scores = torch.sigmoid(torch.as_tensor(arrays["router_logits"]))
        choice = scores + gate.e_score_correction_bias
        ungrouped = torch.topk(choice, ids.shape[1], dim=-1).indices.sort(-1).values.numpy()
        changed = int((ungrouped != np.sort(ids, -1)).any(-1).sum())
        notes.append(
            f"{changed}/{ids.shape[0]} tokens select differently than ungrouped top-k "
            "(group limit matters)"
        )
        assert changed > 0, "group-limited selection never differs; change the seed"
    if fx.model_type in ("deepseek_v3", "minimax_m2", "longcat_flash", "deepseek_v4"):
        gate = _decoder_layers(model)[layer_idx].mlp
        bias = getattr(gate, "e_score_correction_bias", None)
        router = getattr(gate, "gate", None) or getattr(gate, "router", None)
        bias = bias if bias is not None else getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            logits = torch.as_tensor(arrays["router_logits"])
            k = ids.shape[1]
            plain = torch.topk(logits, k, dim=-1).indices.sort(-1).values.numpy()
            changed = int((plain != np.sort(ids, -1)).any(-1).sum())
            notes.append(
                f"{changed}/{ids.shape[0]} tokens select differently than plain top-k "
                "of the logits (bias and/or groups matter)"
            )
            assert changed > 0, "the selection bias never matters; change seed_salt"
    return notes


# ----------------------------------------------------------------------------- main


def make_fixture(fx: Fixture, out_root: Path) -> dict[str, Any]:
    gen = hf.seeded(_seed(fx))
    model = build_model(fx)
    randomize_(model, gen, fx)

    out_dir = out_root / fx.name
    # Reload from disk so the goldens come from exactly the files we ship.
    reloaded = hf.save_and_reload(model, out_dir)
    x_all = torch.randn(len(fx.layers), T, H, generator=gen)
    token_ids = torch.randint(0, VOCAB, (T,), generator=gen)
    summary: dict[str, Any] = {"name": fx.name, "model_type": fx.model_type, "goldens": []}
    with torch.no_grad():
        for i, layer_idx in enumerate(fx.layers):
            x = x_all[i]
            out = run_block(reloaded, fx, layer_idx, x, token_ids)
            ref = run_block(model, fx, layer_idx, x, token_ids)
            torch.testing.assert_close(out["y"], ref["y"], rtol=0, atol=0)
            arrays = hf.to_numpy(out)
            arrays["x"] = x.numpy().astype(np.float32)
            arrays["layer"] = np.asarray(layer_idx, dtype=np.int64)
            fname = "golden.npz" if i == 0 else f"golden_layer{layer_idx}.npz"
            hf.save_npz(out_dir / fname, arrays)
            notes = _diagnostics(reloaded, fx, layer_idx, x, arrays)
            summary["goldens"].append({"file": fname, "layer": layer_idx, "notes": notes})
    summary["size_kb"] = round(hf.dir_bytes(out_dir) / 1024)
    summary["highlights"] = fx.highlights
    return summary


def write_readme(out_root: Path, summaries: list[dict[str, Any]]) -> None:
    lines = [
        *hf.readme_head(
            "MoE golden fixtures (Hugging Face transformers)",
            "/tmp/hfvenv/bin/python checkpoints/goldens/make_moe_goldens.py "
            "--out tests/fixtures/moe",
        ),
        "(`/tmp/hfvenv` is a side venv with torch + transformers + safetensors + numpy.) Each "
        "folder holds `config.json` + `model.safetensors` exactly as `save_pretrained` writes "
        "them (HF's original per-expert key layout where the model type has a conversion "
        "mapping) and "
        "`golden.npz` for one MoE layer. All models are float32, hidden 64, vocab 128, tied "
        "embeddings, every parameter randomized (biases, e_score_correction_bias, norm weights, "
        "router scales included).",
        "",
        "`golden.npz`: `x [7, 64]` (the MoE block input, i.e. after post_attention_layernorm), "
        "`y [7, 64]` (block output, shared experts included, residual NOT added), `layer`, "
        "`router_logits [T, E]` (longcat: E + zero experts; gemma4: `router_probs`, softmaxed), "
        "`expert_ids [T, k]` int32 and `weights [T, k]` (final combine weights, scaling "
        "included) in HF's order (some routers use `topk(sorted=False)`: compare sorted by id), "
        "`y_routed` (routed experts only). deepseek_v4 adds `token_ids [T]`; gemma4 adds "
        "`y_dense`, `y_moe` (see the script's `_gemma4_block`).",
        "",
        *hf.table_head("fixture", "model_type", "goldens (layer)", "size", "highlights"),
    ]
    for s in summaries:
        goldens = ", ".join(f"{g['file']} ({g['layer']})" for g in s["goldens"])
        lines.append(
            f"| `{s['name']}` | {s['model_type']} | {goldens} | {s['size_kb']} KB | "
            f"{s['highlights']} |"
        )
    lines += ["", "Checks recorded when the goldens were made:", ""]
    for s in summaries:
        for g in s["goldens"]:
            for note in g["notes"]:
                lines.append(f"- `{s['name']}/{g['file']}`: {note}")
    lines += [
        "",
        "Notes:",
        "",
        "- `longcat_flash/model.safetensors` also holds `experts.{8..11}.gate_proj/up_proj` for "
        "the zero experts: HF allocates `gate_up_proj` for routed + zero experts but only uses the "
        "routed ones; real LongCat checkpoints do not have these keys. Ignore experts >= "
        "`n_routed_experts`.",
        "- `deepseek_v4` keys are saved in DeepSeek's own naming under a `model.` prefix "
        "(`model.layers.N.ffn.gate.{weight,bias,tid2eid}`, `ffn.experts.E.w{1,2,3}.weight`, "
        "`ffn.shared_experts.w{1,2,3}.weight`); the official checkpoint has no `model.` prefix.",
        "- `gemma4/config.json` carries `per_layer_config` (transformers >= 5 form) instead of "
        "`global_head_dim` / `num_global_key_value_heads` found in the public checkpoints.",
        "- gpt_oss and deepseek_v4 use a lowered `swiglu_limit` so that the clamps are exercised.",
        "",
    ]
    (out_root / "README.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = hf.fixture_parser(__doc__, Path("tests/fixtures/moe"))
    hf.add_only(parser)
    args = hf.parse_args(parser, argv)
    available = set(transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES)
    summaries = []
    for fx in hf.selected(FIXTURES, args.only):
        if fx.model_type not in available:
            print(
                f"skip {fx.name}: model type {fx.model_type} not in transformers "
                f"{transformers.__version__}"
            )
            continue
        s = make_fixture(fx, args.out)
        summaries.append(s)
        notes = "; ".join(n for g in s["goldens"] for n in g["notes"])
        print(f"{fx.name:20s} {s['size_kb']:4d} KB  {notes}")
    if not args.only:
        write_readme(args.out, summaries)


if __name__ == "__main__":
    main()
