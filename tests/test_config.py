"""Config dataclasses: validation, hashing, enum coercion, HF config.json parsing."""

import dataclasses
import enum
import re
from pathlib import Path

import pytest

import atlas_jax as aj
from atlas_jax import config as C
from tests.hf_configs import HF_CONFIGS

BASE = dict(hidden_size=64, intermediate_size=32, num_experts=8, top_k=2)


def moe(**kw):
    return aj.MoEConfig(**{**BASE, **kw})


def test_hashable_equal_and_jit_static():
    a, b = moe(), moe()
    assert a == b and hash(a) == hash(b)
    assert moe(top_k=3) != a
    assert {a: 1}[b] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.top_k = 4  # type: ignore[misc]


def test_strings_coerce_to_enums():
    k = aj.KernelConfig(grouped_matmul="xla", paged_attention="pallas", moe_path="decode")
    assert k.grouped_matmul is C.Backend.XLA
    assert k.paged_attention is C.Backend.PALLAS
    assert k.moe_path is C.MoEPath.DECODE
    assert k == aj.KernelConfig(grouped_matmul=C.Backend.XLA, paged_attention=C.Backend.PALLAS,
                                moe_path=C.MoEPath.DECODE)
    assert moe(expert_format="nvfp4").expert_format is C.Format.NVFP4
    with pytest.raises(ValueError, match=r"KernelConfig.grouped_matmul='cuda': must be one of"):
        aj.KernelConfig(grouped_matmul="cuda")


@pytest.mark.parametrize("cls", [aj.MoEConfig, aj.AttentionConfig, aj.RopeConfig,
                                 aj.KernelConfig])
def test_every_enum_field_coerces_its_strings(cls):
    """Every field whose default is an enum member is in the coercion table (a field missing
    there kept the string, and ``is Backend.PALLAS`` checks then quietly failed)."""
    for f in dataclasses.fields(cls):
        if isinstance(f.default, enum.Enum):
            assert C._ENUM_FIELDS.get(f.name) is type(f.default), f"{cls.__name__}.{f.name}"


@pytest.mark.parametrize(
    "kw, pattern",
    [
        (dict(num_experts=0), r"MoEConfig.num_experts=0: must be a positive int"),
        (dict(hidden_size=-1), r"MoEConfig.hidden_size=-1: must be a positive int"),
        (dict(intermediate_size=0), r"MoEConfig.intermediate_size=0"),
        (dict(top_k=0), r"MoEConfig.top_k=0: must be a positive int"),
        (dict(top_k=9), r"MoEConfig.top_k=9: must be <= num_experts \+ num_zero_experts = 8"),
        (dict(n_group=3), r"MoEConfig.n_group=3: must divide num_experts=8"),
        (dict(n_group=2, topk_group=3), r"MoEConfig.topk_group=3: must be <= n_group=2"),
        (dict(n_group=8), r"n_group=8: groups are scored by their top-2"),
        (dict(n_group=4, topk_group=1, top_k=3), r"top_k=3: must be <= topk_group \* experts"),
        (dict(num_zero_experts=-1), r"num_zero_experts=-1: must be a non-negative int"),
        (dict(router_dtype="float64"), r"router_dtype='float64': must be one of"),
        (dict(routed_scaling_factor=float("nan")), r"routed_scaling_factor=nan"),
        (dict(routed_scaling_factor=0.0), r"routed_scaling_factor=0.0: must be > 0"),
        (dict(norm_eps=-1.0), r"norm_eps=-1.0: must be a finite number >= 0"),
        (dict(activation="gpt_oss"), r"swiglu_limit=None: the gpt-oss activation needs a limit"),
        (dict(activation="gelu_tanh", swiglu_limit=7.0), r"swiglu_limit=7.0: only SiLU"),
        (dict(swiglu_limit=-1.0), r"swiglu_limit=-1.0: must be > 0"),
        (dict(per_expert_scale=True), r"per_expert_scale=True: requires gemma_router=True"),
        (dict(shared_expert_gate=True), r"shared_expert_gate=True: needs shared_intermediate"),
        (dict(fp8_block=(0, 128)), r"fp8_block=\(0, 128\): must be two positive ints"),
        (dict(hidden_size=40, expert_format="nvfp4"),
         r"expert_format='nvfp4': hidden_size=40 must be divisible by its block 16"),
        (dict(intermediate_size=48, expert_format="mxfp4"),
         r"expert_format='mxfp4': intermediate_size=48 must be divisible by its block 32"),
        (dict(shared_intermediate_size=24, shared_expert_format="nvfp4"),
         r"shared_expert_format='nvfp4': shared_intermediate_size=24 must be divisible by its"),
        (dict(gate_up_act_quant="fp8"),
         r"gate_up_act_quant='fp8': gate_up activation quantization fp8 needs "
         r"expert_format=fp8_block, got bf16"),
        (dict(down_act_quant="nvfp4", expert_format="fp8_block"), r"down_act_quant='nvfp4'"),
        (dict(hash_vocab_size=10, num_zero_experts=2), r"hash routing cannot be combined"),
        (dict(scoring="topk_softmax", selection_bias=True), r"selection_bias=True"),
        (dict(scoring="argmax"), r"MoEConfig.scoring='argmax': must be one of 'softmax'"),
        (dict(n_group=2, topk_group=1, top_k=2, num_zero_experts=1),
         r"zero experts cannot be combined with group-limited"),
    ],
)
def test_moe_config_validation(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        moe(**kw)


def test_moe_config_valid_corners():
    assert moe(top_k=10, num_zero_experts=2).num_router_outputs == 10
    assert moe(n_group=4, topk_group=2, top_k=4).n_group == 4
    assert moe(expert_format="nvfp4", hidden_size=64, intermediate_size=32).expert_format
    assert moe(shared_intermediate_size=16).shared_format is C.Format.BF16
    assert moe(shared_intermediate_size=16, shared_expert_format="fp8_block",
               expert_format="nvfp4").shared_format is C.Format.FP8_BLOCK
    assert moe(expert_format="fp8_block", hidden_size=65).hidden_size == 65  # FP8 edge blocks
    assert moe(gate_up_act_quant="fp8", expert_format="fp8_block").gate_up_act_quant


ATT = dict(hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize(
    "kw, pattern",
    [
        (dict(num_kv_heads=3), r"AttentionConfig.num_kv_heads=3: must divide num_heads=8"),
        (dict(num_heads=0), r"AttentionConfig.num_heads=0: must be a positive int"),
        (dict(head_dim=15), r"head_dim=15: must be even"),
        (dict(sliding_window=0), r"sliding_window=0: must be a positive int"),
        (dict(scale=0.0), r"scale=0.0: must be > 0 or None"),
        (dict(logit_softcap=-3.0), r"logit_softcap=-3.0"),
        (dict(weight_format="mxfp4", hidden_size=48), r"hidden_size=48 must be divisible by .*32"),
        (dict(fp8_kv_calibration_tokens=-1), r"fp8_kv_calibration_tokens=-1"),
        (dict(output_gate="tanh"), r"output_gate='tanh': must be one of"),
        (dict(rope=C.RopeConfig(style="mrope", mrope_section=(2, 2, 2))),
         r"rope.mrope_section=\(2, 2, 2\): must sum to rotary_dim/2 = 8"),
    ],
)
def test_attention_config_validation(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        aj.AttentionConfig(**{**ATT, **kw})


@pytest.mark.parametrize(
    "kw, pattern",
    [
        (dict(theta=0.0), r"RopeConfig.theta=0.0: must be > 0"),
        (dict(partial_rotary_factor=1.5), r"partial_rotary_factor=1.5: must be in \(0, 1\]"),
        (dict(scaling="yarn", factor=4.0), r"original_max_position_embeddings=None: YaRN needs"),
        (dict(style="mrope"), r"mrope_section=None: style=mrope needs mrope_section"),
        (dict(mrope_section=(1, 2, 3)), r"needs style=mrope"),
        (dict(style="mrope", mrope_section=(1, 2)), r"must be 3 non-negative ints"),
        (dict(scaling="ntk"), r"RopeConfig.scaling='ntk': must be one of"),
    ],
)
def test_rope_config_validation(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        C.RopeConfig(**kw)


def test_rope_rotary_dim_and_defaults():
    assert C.RopeConfig(partial_rotary_factor=0.25).rotary_dim(256) == 64
    assert C.RopeConfig().rotary_dim(128) == 128
    a = aj.AttentionConfig(**ATT)
    assert a.q_per_kv == 4 and a.softmax_scale == 16**-0.5
    assert aj.AttentionConfig(**ATT, scale=0.5).softmax_scale == 0.5


@pytest.mark.parametrize(
    "kw, pattern",
    [
        (dict(gmm_block_m=96), r"KernelConfig.gmm_block_m=96: must be a power of two"),
        (dict(gmm_block_k=0), r"gmm_block_k=0: must be a positive int"),
        (dict(attn_num_splits=0), r"attn_num_splits=0: must be a positive int"),
        (dict(decode_max_tokens=0), r"decode_max_tokens=0"),
        (dict(moe_path="both"), r"moe_path='both': must be one of 'auto', 'decode', 'prefill'"),
    ],
)
def test_kernel_config_validation(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        aj.KernelConfig(**kw)


# ---------------------------------------------------------------------------------------------
# from_hf_config on the public config.json of each architecture
# ---------------------------------------------------------------------------------------------

MOE_TYPES = ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss", "qwen3_next",
             "longcat_flash", "minimax_m2", "deepseek_v4", "gemma4"]


def test_all_ten_public_configs_present():
    assert set(MOE_TYPES) <= set(HF_CONFIGS)
    assert set(MOE_TYPES) == set(C.SUPPORTED_MODEL_TYPES)


def _text(d):
    return d.get("text_config") or d


def test_qwen3_moe():
    d = HF_CONFIGS["qwen3_moe"]
    c = aj.MoEConfig.from_hf_config(d)
    assert (c.hidden_size, c.intermediate_size, c.num_experts, c.top_k) == (
        d["hidden_size"], d["moe_intermediate_size"], d["num_experts"], d["num_experts_per_tok"])
    assert c.scoring is C.RouterScoring.SOFTMAX and c.norm_topk_prob is d["norm_topk_prob"]
    assert c.activation is C.Activation.SILU and c.shared_intermediate_size == 0
    a = aj.AttentionConfig.from_hf_config(d)
    assert a.qk_norm and not a.qkv_bias and a.norm_style is C.NormStyle.SCALE
    assert (a.num_heads, a.num_kv_heads, a.head_dim) == (
        d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"])


def test_qwen2_moe_shared_expert_gate():
    d = HF_CONFIGS["qwen2_moe"]
    c = aj.MoEConfig.from_hf_config(d)
    assert c.shared_intermediate_size == d["shared_expert_intermediate_size"]
    assert c.shared_expert_gate and c.norm_topk_prob is d["norm_topk_prob"]
    a = aj.AttentionConfig.from_hf_config(d)
    assert a.qkv_bias and not a.qk_norm


def test_mixtral():
    d = HF_CONFIGS["mixtral"]
    c = aj.MoEConfig.from_hf_config(d)
    assert (c.num_experts, c.top_k, c.intermediate_size) == (
        d["num_local_experts"], d["num_experts_per_tok"], d["intermediate_size"])
    assert c.norm_topk_prob and c.scoring is C.RouterScoring.SOFTMAX
    assert aj.AttentionConfig.from_hf_config(d).rope.theta == pytest.approx(
        d.get("rope_theta", 1e6))


def test_deepseek_v3():
    d = HF_CONFIGS["deepseek_v3"]
    c = aj.MoEConfig.from_hf_config(d)
    assert c.scoring is C.RouterScoring.SIGMOID and c.selection_bias
    assert (c.n_group, c.topk_group, c.num_experts, c.top_k) == (
        d["n_group"], d["topk_group"], d["n_routed_experts"], d["num_experts_per_tok"])
    assert c.routed_scaling_factor == d["routed_scaling_factor"] and c.norm_eps == 1e-20
    assert c.shared_intermediate_size == d["n_shared_experts"] * d["moe_intermediate_size"]
    assert not c.shared_expert_gate
    if "quantization_config" in d:
        assert c.expert_format is C.Format.FP8_BLOCK
        assert c.fp8_block == tuple(d["quantization_config"]["weight_block_size"])
    with pytest.raises(NotImplementedError, match="multi-head latent attention"):
        aj.AttentionConfig.from_hf_config(d)


def test_gpt_oss():
    d = HF_CONFIGS["gpt_oss"]
    c = aj.MoEConfig.from_hf_config(d)
    assert c.scoring is C.RouterScoring.TOPK_SOFTMAX and c.router_bias and c.expert_bias
    assert c.activation is C.Activation.GPT_OSS and c.swiglu_limit == d.get("swiglu_limit", 7.0)
    assert c.gate_up_layout is C.GateUpLayout.INTERLEAVED
    if "quantization_config" in d:
        assert c.expert_format is C.Format.MXFP4
    a = aj.AttentionConfig.from_hf_config(d)
    assert a.sinks and a.qkv_bias and a.o_bias and a.rope.scaling is C.RopeScaling.YARN


def test_attention_bias_rules_and_fp8_block():
    """Qwen3 family: o_proj bias = attention_bias (as q/k/v); Qwen2-MoE: qkv_bias (default on),
    o_proj never; an FP8 quantization_config sets fp8_block, not weight_format (the loader
    reads each weight's format from the stored tensors: attention is often left unquantized)."""
    q3 = dict(HF_CONFIGS["qwen3"])
    for bias in (False, True):
        a = aj.AttentionConfig.from_hf_config({**q3, "attention_bias": bias})
        assert a.qkv_bias == a.o_bias == bias
    q2 = dict(HF_CONFIGS["qwen2_moe"])
    a = aj.AttentionConfig.from_hf_config({k: v for k, v in q2.items() if k != "qkv_bias"})
    assert a.qkv_bias and not a.o_bias
    assert not aj.AttentionConfig.from_hf_config({**q2, "qkv_bias": False}).qkv_bias
    fp8 = {**q3, "quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 32]}}
    a = aj.AttentionConfig.from_hf_config(fp8)
    assert a.weight_format is C.Format.BF16 and a.fp8_block == (64, 32)
    assert aj.AttentionConfig.from_hf_config(q3).fp8_block == (128, 128)
    with pytest.raises(ValueError, match=r"AttentionConfig.fp8_block=\(0, 128\)"):
        aj.AttentionConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                           fp8_block=(0, 128))


def test_qwen3_next():
    d = HF_CONFIGS["qwen3_next"]
    c = aj.MoEConfig.from_hf_config(d)
    assert c.shared_intermediate_size == d["shared_expert_intermediate_size"]
    assert c.shared_expert_gate and c.num_experts == d["num_experts"]
    a = aj.AttentionConfig.from_hf_config(d)
    assert a.output_gate is C.OutputGate.ELEMENTWISE and a.norm_style is C.NormStyle.OFFSET
    assert a.rope.partial_rotary_factor == d["partial_rotary_factor"]
    assert a.rope.rotary_dim(a.head_dim) == int(d["head_dim"] * d["partial_rotary_factor"])


def test_longcat_flash_zero_experts():
    d = HF_CONFIGS["longcat_flash"]
    c = aj.MoEConfig.from_hf_config(d)
    assert c.num_zero_experts == d["zero_expert_num"] > 0
    assert c.num_router_outputs == d["n_routed_experts"] + d["zero_expert_num"]
    assert not c.norm_topk_prob and c.selection_bias
    assert c.routed_scaling_factor == d["routed_scaling_factor"]


def test_minimax_m2():
    d = HF_CONFIGS["minimax_m2"]
    c = aj.MoEConfig.from_hf_config(d)
    assert c.scoring is C.RouterScoring.SIGMOID and c.selection_bias and c.norm_topk_prob
    assert c.routed_scaling_factor == 1.0 and c.num_experts == d["num_local_experts"]
    # q_norm / k_norm are RMSNorms over the whole projection, not per head: not implemented.
    with pytest.raises(NotImplementedError, match=r"model_type 'minimax_m2': MiniMax-M2 "
                                                  r"RMS-normalizes q and k over the whole "
                                                  r"projection .* not per head"):
        aj.AttentionConfig.from_hf_config(d)


def test_deepseek_v4_hash_layers():
    d = HF_CONFIGS["deepseek_v4"]
    c = aj.MoEConfig.from_hf_config(d)
    assert c.scoring is C.RouterScoring.SQRT_SOFTPLUS and c.norm_topk_prob
    assert not c.hash_routing
    assert c.shared_intermediate_size == (d["moe_intermediate_size"] if d.get("n_shared_experts")
                                          else 0)
    assert c.router_dtype == ("bfloat16" if d.get("torch_dtype", d.get("dtype")) == "bfloat16"
                              else "float32")
    if d.get("num_hash_layers"):
        h = aj.MoEConfig.from_hf_config(d, layer=0)
        assert h.hash_routing and h.hash_vocab_size == d["vocab_size"]
        last = aj.MoEConfig.from_hf_config(d, layer=d["num_hash_layers"])
        assert not last.hash_routing


def test_gemma4_text_config():
    d = HF_CONFIGS["gemma4"]
    t = _text(d)
    c = aj.MoEConfig.from_hf_config(d)
    assert c.gemma_router and c.per_expert_scale and c.pre_expert_norm
    assert c.num_experts == t["num_experts"] and c.top_k == t["top_k_experts"]
    off = {**d, "text_config": {**t, "enable_moe_block": False}} if "text_config" in d else {
        **d, "enable_moe_block": False}
    with pytest.raises(ValueError, match="enable_moe_block"):
        aj.MoEConfig.from_hf_config(off)
    # Attention: the wrapper's model_type (and a bare text part's) names the reason.
    for cfg, model_type in ((d, d["model_type"]), (t, t["model_type"])):
        with pytest.raises(NotImplementedError,
                           match=rf"model_type '{model_type}': Gemma-4 attention"):
            aj.AttentionConfig.from_hf_config(cfg)


def test_unknown_model_type_lists_supported():
    with pytest.raises(ValueError, match=r"model_type 'llama4'; supported: .*qwen3_moe"):
        aj.MoEConfig.from_hf_config({"model_type": "llama4"})
    with pytest.raises(ValueError, match=r"unsupported model_type 'bert'; supported: .*qwen3"):
        aj.AttentionConfig.from_hf_config({"model_type": "bert"})
    with pytest.raises(TypeError, match="expects a dict"):
        aj.MoEConfig.from_hf_config("config.json")  # type: ignore[arg-type]


def test_missing_key_names_it():
    d = dict(HF_CONFIGS["qwen3_moe"])
    del d["num_experts"]
    with pytest.raises(ValueError, match=r"'qwen3_moe' lacks key 'num_experts' / 'num_local_"):
        aj.MoEConfig.from_hf_config(d)


@pytest.mark.parametrize(
    "qc, fmt",
    [
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, C.Format.NVFP4),
        ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}, C.Format.NVFP4),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, C.Format.FP8_BLOCK),
        ({"quant_method": "mxfp4"}, C.Format.MXFP4),
    ],
)
def test_quantization_config_sets_format(qc, fmt):
    d = {**HF_CONFIGS["qwen3_moe"], "quantization_config": qc}
    assert aj.MoEConfig.from_hf_config(d).expert_format is fmt


def test_unknown_quant_method_lists_supported():
    d = {**HF_CONFIGS["qwen3_moe"], "quantization_config": {"quant_method": "awq"}}
    with pytest.raises(ValueError, match=r"unsupported quant_method 'awq'; supported: modelopt"):
        aj.MoEConfig.from_hf_config(d)
    d["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8"}
    with pytest.raises(NotImplementedError, match="quant_algo 'FP8'"):
        aj.MoEConfig.from_hf_config(d)


def test_rope_from_hf_variants():
    base = {"model_type": "qwen3", "max_position_embeddings": 4096}
    assert C.RopeConfig.from_hf_config({**base, "rope_theta": 5e5}).theta == 5e5
    y = C.RopeConfig.from_hf_config({**base, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
        "original_max_position_embeddings": 1024}})
    assert y.scaling is C.RopeScaling.YARN and y.factor == 4.0
    assert y.original_max_position_embeddings == 1024
    legacy = C.RopeConfig.from_hf_config({**base, "rope_theta": 1e6, "rope_scaling": {
        "type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048}})
    assert legacy.scaling is C.RopeScaling.YARN and legacy.theta == 1e6
    with pytest.raises(NotImplementedError, match="rope_type 'longrope'"):
        C.RopeConfig.from_hf_config({**base, "rope_parameters": {"rope_type": "longrope"}})


def test_every_config_field_is_documented():
    doc = (Path(__file__).parent.parent / "docs" / "config.md").read_text()
    for cls in (aj.MoEConfig, aj.AttentionConfig, aj.RopeConfig, aj.KernelConfig):
        section = re.search(rf"## `{cls.__name__}`\n(.*?)(\n## |\Z)", doc, re.S)
        assert section, cls.__name__
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in section.group(1), f"{cls.__name__}.{f.name} undocumented"
