"""Configuration dataclasses and enums.

Every feature flag of the engine is a field of one of these frozen, hashable dataclasses (never an
environment variable); ``docs/config.md`` maps the engine's environment variables onto fields.
Construction validates: an invalid value or combination raises ``ValueError`` naming the field,
the value and the rule. Mutually exclusive choices are enums; string values are accepted
wherever an enum is expected (``KernelConfig(grouped_matmul="xla")``) and converted on
construction, so equal configs compare and hash equal.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Mapping
from typing import Any

# ----------------------------------------------------------------------------------------------
# Enums
# ----------------------------------------------------------------------------------------------


class Format(enum.Enum):
    """Storage format of a weight tensor (``QTensor.format``)."""

    BF16 = "bf16"  # plain floating point (bf16/f16/f32), no scales
    FP8_BLOCK = "fp8_block"  # E4M3 values, one fp32 scale_inv per (b0 x b1) block (DeepSeek-V3)
    NVFP4 = "nvfp4"  # E2M1 pairs per byte, E4M3 scale per 16 along K, fp32 global (ModelOpt)
    MXFP4 = "mxfp4"  # E2M1 pairs per byte, E8M0 scale per 32 along K (OCP MX, gpt-oss)


WeightFormat = Format

# Elements along K that share one scale, for the formats with a fixed block.
FORMAT_K_BLOCK = {Format.NVFP4: 16, Format.MXFP4: 32}


class RouterScoring(enum.Enum):
    """How router logits become expert scores."""

    SOFTMAX = "softmax"  # fp32 softmax over experts -> top-k (Qwen2/3-MoE, Mixtral, LongCat)
    SIGMOID = "sigmoid"  # sigmoid per expert -> top-k on score + bias (DeepSeek-V3, MiniMax-M2)
    SQRT_SOFTPLUS = "sqrt_softplus"  # sqrt(softplus(logit)) -> top-k (DeepSeek-V4)
    TOPK_SOFTMAX = "topk_softmax"  # top-k on logits, softmax over the k selected (gpt-oss)


class Activation(enum.Enum):
    """Gated activation of the expert MLP: ``act(gate) * up``."""

    SILU = "silu"  # SwiGLU: silu(gate) * up (optionally clamped, see MoEConfig.swiglu_limit)
    GELU_TANH = "gelu_tanh"  # GeGLU: gelu_tanh(gate) * up
    GPT_OSS = "gpt_oss"  # (clamp(up, -l, l) + 1) * g * sigmoid(1.702 g), g = min(gate, l)


class GateUpLayout(enum.Enum):
    """Row layout of the fused gate_up weight [E, 2I, H]."""

    CONCATENATED = "concatenated"  # rows [0, I) gate, [I, 2I) up
    INTERLEAVED = "interleaved"  # gate = even rows, up = odd rows (gpt-oss)


class WeightLayout(enum.Enum):
    """Which orientation(s) of the expert weights are kept on device (decided once at load)."""

    NK = "nk"  # [N, K] as checkpoints store it (quantized along K)
    KN = "kn"  # a transposed [K, N] copy only
    BOTH = "both"  # both copies: [N, K] for decode, [K, N] for prefill (engine's hybrid layout)


class ActQuant(enum.Enum):
    """Quantization of the activations fed to an expert matmul."""

    NONE = "none"  # activations stay bf16/f32 (W*A16)
    FP8 = "fp8"  # E4M3 per token per 128 along K (W8A8, FP8_BLOCK weights only)
    NVFP4 = "nvfp4"  # E2M1 + E4M3 per 16 (W4A4, NVFP4 weights only; needs FP4 tensor cores)


class KVDtype(enum.Enum):
    """Storage dtype of the paged KV cache."""

    FLOAT32 = "float32"
    BF16 = "bf16"
    FP8 = "fp8"  # E4M3 with fp32 scales
    NVFP4 = "nvfp4"  # E2M1 + E4M3 scale per 16 elements


class NormStyle(enum.Enum):
    """RMSNorm weight convention."""

    SCALE = "scale"  # x * w (Qwen3, Llama)
    OFFSET = "offset"  # x * (1 + w), zero-centred weight (Qwen3-Next, Gemma)


class OutputGate(enum.Enum):
    """Gate applied to the attention output before o_proj."""

    NONE = "none"
    ELEMENTWISE = "elementwise"  # q_proj yields [q_h | gate_h] per head; out *= sigmoid(gate)
    HEADWISE_SIGMOID = "headwise_sigmoid"  # one scalar per head: out_h *= sigmoid(g_h)
    HEADWISE_SOFTPLUS = "headwise_softplus"  # one scalar per head: out_h *= softplus(g_h)


class RopeStyle(enum.Enum):
    """Which pairs of dimensions RoPE rotates."""

    NEOX = "neox"  # rotate-half: (x[i], x[i + d/2])
    GPTJ = "gptj"  # interleaved: (x[2i], x[2i + 1])
    MROPE = "mrope"  # Qwen3-VL interleaved multimodal rope over 3-D positions


class RopeScaling(enum.Enum):
    """Frequency scaling of RoPE."""

    NONE = "none"  # transformers' "default"
    LINEAR = "linear"  # positions / factor
    YARN = "yarn"  # YaRN ramp between beta_fast and beta_slow, mscale attention factor


class Backend(enum.Enum):
    """Implementation of a kernel-boundary op."""

    AUTO = "auto"  # Pallas on GPU, XLA reference elsewhere (said once in a log line)
    PALLAS = "pallas"  # Pallas kernel; interpret mode when no GPU is present
    XLA = "xla"  # plain-jnp reference


class GmmKernel(enum.Enum):
    """Which family of Pallas kernels ``grouped_matmul="pallas"`` runs: for the prefill grouped
    matmul (``KernelConfig.gmm_kernel``) and for the MoE decode kernels
    (``KernelConfig.decode_kernel``); and which paged-attention decode kernel
    ``paged_attention="pallas"`` runs (``KernelConfig.attn_decode_kernel``)."""

    AUTO = "auto"  # Mosaic GPU where it supports the call and measured faster on Hopper (sm_90)
    TRITON = "triton"  # Triton lowering: every format, every NVIDIA generation
    MOSAIC = "mosaic"  # Mosaic GPU (TMA + wgmma), sm_90: prefill BF16; decode BF16, FP8, FP4;
    #   paged decode over FP8 KV


class MoEPath(enum.Enum):
    """Which MoE variant ``moe_forward`` runs."""

    AUTO = "auto"  # decode for few tokens, prefill otherwise (KernelConfig.decode_max_tokens)
    DECODE = "decode"  # gather only the selected experts' weights
    PREFILL = "prefill"  # sort rows by expert, grouped matmul


_ENUM_FIELDS: dict[str, type[enum.Enum]] = {
    "scoring": RouterScoring,
    "activation": Activation,
    "gate_up_layout": GateUpLayout,
    "expert_format": Format,
    "shared_expert_format": Format,
    "weight_format": Format,
    "weight_layout": WeightLayout,
    "gate_up_act_quant": ActQuant,
    "down_act_quant": ActQuant,
    "norm_style": NormStyle,
    "output_gate": OutputGate,
    "style": RopeStyle,
    "scaling": RopeScaling,
    "grouped_matmul": Backend,
    "paged_attention": Backend,
    "router": Backend,
    "moe_path": MoEPath,
    "gmm_kernel": GmmKernel,
    "decode_kernel": GmmKernel,
    "attn_decode_kernel": GmmKernel,
}


# ----------------------------------------------------------------------------------------------
# Validation helpers
# ----------------------------------------------------------------------------------------------


def _fail(cls: str, field: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"{cls}.{field}={value!r}: {rule}")


def _coerce_enums(obj: Any) -> None:
    """Turn string values of enum-typed fields into the enum (frozen-safe), or raise."""
    for f in dataclasses.fields(obj):
        enum_cls = _ENUM_FIELDS.get(f.name)
        value = getattr(obj, f.name)
        if enum_cls is None or value is None or isinstance(value, enum_cls):
            continue
        try:
            object.__setattr__(obj, f.name, enum_cls(value))
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in enum_cls)
            raise _fail(type(obj).__name__, f.name, value, f"must be one of {allowed}") from None


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise _fail(type(obj).__name__, name, value, "must be a positive int")


def _non_negative(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise _fail(type(obj).__name__, name, value, "must be a non-negative int")


def _check_block(cls: str, field: str, fmt: Format | None, dim_name: str, dim: int) -> None:
    block = FORMAT_K_BLOCK.get(fmt) if fmt is not None else None
    if block is not None and dim % block:
        raise _fail(cls, field, fmt.value,
                    f"{dim_name}={dim} must be divisible by its block {block}")


_ROUTER_DTYPES = ("float32", "bfloat16", "float16")


# ----------------------------------------------------------------------------------------------
# MoE
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """One MoE layer. Defaults give Qwen3-MoE semantics (softmax, top-k, renormalised, SwiGLU)."""

    hidden_size: int  # H, model width
    intermediate_size: int  # I, hidden width of one routed expert
    num_experts: int  # E, routed experts (excluding zero experts)
    top_k: int  # k, experts per token (zero experts count towards k)
    scoring: RouterScoring = RouterScoring.SOFTMAX  # router scoring rule
    norm_topk_prob: bool = True  # renormalise the k selected weights to sum to 1
    norm_eps: float = 0.0  # added to the renormalisation denominator (DeepSeek: 1e-20)
    routed_scaling_factor: float = 1.0  # multiplies the final routing weights
    n_group: int = 1  # expert groups for group-limited selection (DeepSeek-V3)
    topk_group: int = 1  # groups kept per token (must be <= n_group)
    selection_bias: bool = False  # per-expert bias added to scores for selection only
    router_bias: bool = False  # bias on the router logits (gpt-oss)
    router_dtype: str = "float32"  # dtype of the router matmul and scoring (engine FP32 gate)
    num_zero_experts: int = 0  # Z identity ("zero-computation") experts, ids E..E+Z-1 (LongCat)
    hash_vocab_size: int = 0  # >0: hash routing, expert ids = tid2eid[token_id] (DeepSeek-V4)
    gemma_router: bool = False  # router input: weightless RMSNorm * scale[H] * H^-0.5 (Gemma-4)
    per_expert_scale: bool = False  # routing weight *= per_expert_scale[id] (Gemma-4)
    pre_expert_norm: bool = False  # experts read RMSNorm(x) with its own weight (Gemma-4)
    activation: Activation = Activation.SILU  # gated activation of every expert
    swiglu_limit: float | None = None  # clamp: gpt-oss limit, or DeepSeek-V4 gate<=l, abs(up)<=l
    gate_up_layout: GateUpLayout = GateUpLayout.CONCATENATED  # row layout of gate_up [E, 2I, H]
    expert_bias: bool = False  # biases on gate_up and down (gpt-oss)
    expert_format: Format = Format.BF16  # storage format of the routed experts
    shared_intermediate_size: int = 0  # hidden width of the shared expert (0: none)
    shared_expert_format: Format | None = None  # shared expert's format (None: expert_format)
    shared_expert_gate: bool = False  # shared output *= sigmoid(x . w_gate) (Qwen2-MoE/Next)
    rms_norm_eps: float = 1e-6  # epsilon of the router / pre-expert RMSNorms
    fp8_block: tuple[int, int] = (128, 128)  # FP8_BLOCK weight block (b0 along N, b1 along K)
    weight_layout: WeightLayout = WeightLayout.NK  # expert weight orientation(s) kept on device
    # activation quantization into gate_up / down: FP8 = W8A8 (e4m3 per token per 128 of K)
    # for the layer's FP8_BLOCK expert matmuls; NVFP4 raises NotImplementedError in moe_forward
    gate_up_act_quant: ActQuant = ActQuant.NONE
    down_act_quant: ActQuant = ActQuant.NONE

    def __post_init__(self) -> None:
        _coerce_enums(self)
        name = "MoEConfig"
        _positive(self, "hidden_size", "intermediate_size", "num_experts", "top_k")
        _positive(self, "n_group", "topk_group")
        _non_negative(self, "num_zero_experts", "hash_vocab_size", "shared_intermediate_size")
        total = self.num_experts + self.num_zero_experts
        if self.top_k > total:
            raise _fail(name, "top_k", self.top_k,
                        f"must be <= num_experts + num_zero_experts = {total}")
        if self.num_experts % self.n_group:
            raise _fail(name, "n_group", self.n_group,
                        f"must divide num_experts={self.num_experts}")
        if self.topk_group > self.n_group:
            raise _fail(name, "topk_group", self.topk_group, f"must be <= n_group={self.n_group}")
        if self.n_group > 1:
            per_group = self.num_experts // self.n_group
            if per_group < 2:
                raise _fail(name, "n_group", self.n_group,
                            "groups are scored by their top-2 experts: need >= 2 experts a group")
            if self.top_k > self.topk_group * per_group:
                raise _fail(name, "top_k", self.top_k,
                            f"must be <= topk_group * experts per group = "
                            f"{self.topk_group * per_group}")
            if self.num_zero_experts:
                raise _fail(name, "num_zero_experts", self.num_zero_experts,
                            "zero experts cannot be combined with group-limited routing")
        if self.router_dtype not in _ROUTER_DTYPES:
            raise _fail(name, "router_dtype", self.router_dtype, f"must be one of {_ROUTER_DTYPES}")
        if self.hash_vocab_size and self.num_zero_experts:
            raise _fail(name, "hash_vocab_size", self.hash_vocab_size,
                        "hash routing cannot be combined with zero experts")
        if self.scoring is RouterScoring.TOPK_SOFTMAX and self.selection_bias:
            raise _fail(name, "selection_bias", True,
                        "top-k-then-softmax routing has no selection bias")
        for field in ("norm_eps", "routed_scaling_factor", "rms_norm_eps"):
            value = getattr(self, field)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise _fail(name, field, value, "must be a finite number >= 0")
        if self.routed_scaling_factor == 0:
            raise _fail(name, "routed_scaling_factor", 0.0, "must be > 0")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise _fail(name, "swiglu_limit", self.swiglu_limit, "must be > 0 or None")
        if self.activation is Activation.GPT_OSS and self.swiglu_limit is None:
            raise _fail(name, "swiglu_limit", None, "the gpt-oss activation needs a limit (7.0)")
        if self.activation is Activation.GELU_TANH and self.swiglu_limit is not None:
            raise _fail(name, "swiglu_limit", self.swiglu_limit, "only SiLU/gpt-oss clamp")
        if self.per_expert_scale and not self.gemma_router:
            raise _fail(name, "per_expert_scale", True, "requires gemma_router=True")
        b0, b1 = self.fp8_block
        if not (isinstance(b0, int) and isinstance(b1, int) and b0 > 0 and b1 > 0):
            raise _fail(name, "fp8_block", self.fp8_block, "must be two positive ints")
        # The formats with a fixed K block must divide the dimension they pack along K:
        # gate_up packs along H, down along I.
        _check_block(name, "expert_format", self.expert_format, "hidden_size", self.hidden_size)
        _check_block(name, "expert_format", self.expert_format,
                     "intermediate_size", self.intermediate_size)
        if self.shared_intermediate_size:
            fmt = self.shared_format
            _check_block(name, "shared_expert_format", fmt, "hidden_size", self.hidden_size)
            _check_block(name, "shared_expert_format", fmt,
                         "shared_intermediate_size", self.shared_intermediate_size)
        elif self.shared_expert_gate:
            raise _fail(name, "shared_expert_gate", True, "needs shared_intermediate_size > 0")
        for field, fmt_field in (("gate_up_act_quant", "gate_up"), ("down_act_quant", "down")):
            quant = getattr(self, field)
            needed = {ActQuant.FP8: Format.FP8_BLOCK, ActQuant.NVFP4: Format.NVFP4}.get(quant)
            if needed is not None and self.expert_format is not needed:
                raise _fail(name, field, quant.value,
                            f"{fmt_field} activation quantization {quant.value} needs "
                            f"expert_format={needed.value}, got {self.expert_format.value}")

    @property
    def shared_format(self) -> Format:
        """The shared expert's storage format."""
        return self.shared_expert_format or self.expert_format

    @property
    def num_router_outputs(self) -> int:
        """Rows of the router weight: routed plus zero experts."""
        return self.num_experts + self.num_zero_experts

    @property
    def hash_routing(self) -> bool:
        return self.hash_vocab_size > 0

    def replace(self, **changes: Any) -> MoEConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any], *, layer: int | None = None) -> MoEConfig:
        """MoE layer config from an HF ``config.json`` dict (see ``SUPPORTED_MODEL_TYPES``).

        ``layer`` picks per-layer variants (DeepSeek-V4 hash layers); ``None`` describes the
        model's regular MoE layers. A ``quantization_config`` sets ``expert_format``.
        """
        text = _text_config(d)
        parse = _MOE_PARSERS.get(_model_type(d))
        if parse is None:
            raise _unknown_model_type(d)
        cfg = parse(_Keys(text), layer)
        return cfg.replace(**_format_fields(d))


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding."""

    theta: float = 10000.0  # base frequency
    style: RopeStyle = RopeStyle.NEOX  # which dimension pairs rotate
    partial_rotary_factor: float = 1.0  # fraction of head_dim that rotates (Qwen3-Next 0.25)
    scaling: RopeScaling = RopeScaling.NONE  # frequency scaling
    factor: float = 1.0  # scaling factor (linear / YaRN)
    original_max_position_embeddings: int | None = None  # YaRN's pre-extension context
    beta_fast: float = 32.0  # YaRN high-frequency boundary (rotations)
    beta_slow: float = 1.0  # YaRN low-frequency boundary (rotations)
    mscale: float | None = None  # YaRN mscale (DeepSeek style), None: unused
    mscale_all_dim: float | None = None  # YaRN mscale_all_dim (DeepSeek style), None: unused
    attention_factor: float | None = None  # YaRN cos/sin multiplier override
    truncate: bool = True  # YaRN: floor/ceil the correction range (gpt-oss sets False)
    mrope_section: tuple[int, ...] | None = None  # MROPE: frequencies per (t, h, w) axis

    def __post_init__(self) -> None:
        _coerce_enums(self)
        name = "RopeConfig"
        if not self.theta > 0:
            raise _fail(name, "theta", self.theta, "must be > 0")
        if not 0 < self.partial_rotary_factor <= 1:
            raise _fail(name, "partial_rotary_factor", self.partial_rotary_factor,
                        "must be in (0, 1]")
        if not self.factor > 0:
            raise _fail(name, "factor", self.factor, "must be > 0")
        if self.scaling is RopeScaling.YARN and not self.original_max_position_embeddings:
            raise _fail(name, "original_max_position_embeddings",
                        self.original_max_position_embeddings, "YaRN needs a positive value")
        if self.mrope_section is not None:
            object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
            if self.style is not RopeStyle.MROPE:
                raise _fail(name, "mrope_section", self.mrope_section, "needs style=mrope")
            if len(self.mrope_section) != 3 or min(self.mrope_section) < 0:
                raise _fail(name, "mrope_section", self.mrope_section,
                            "must be 3 non-negative ints (t, h, w)")
        elif self.style is RopeStyle.MROPE:
            raise _fail(name, "mrope_section", None, "style=mrope needs mrope_section")

    def rotary_dim(self, head_dim: int) -> int:
        """Number of leading head dimensions that rotate (even)."""
        dim = int(head_dim * self.partial_rotary_factor)
        return dim - dim % 2

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any]) -> RopeConfig:
        """RoPE from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``."""
        text = _text_config(d)
        params = dict(text.get("rope_scaling") or {})
        params.update(text.get("rope_parameters") or {})
        if "full_attention" in params:  # per-layer-type dict (Gemma): the full-attention layers
            params = dict(params["full_attention"])
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = params.get("rope_theta", text.get("rope_theta", 10000.0))
        partial = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
        if "rotary_dim" in text and "head_dim" in text:  # MiniMax-M2 states the dim itself
            partial = text["rotary_dim"] / text["head_dim"]
        common = dict(theta=float(theta), partial_rotary_factor=float(partial))
        if params.get("mrope_section"):
            common.update(style=RopeStyle.MROPE, mrope_section=tuple(params["mrope_section"]))
        match rope_type:
            case "default" | None:
                return cls(**common)
            case "linear":
                return cls(scaling=RopeScaling.LINEAR, factor=float(params["factor"]), **common)
            case "yarn":
                return cls(
                    scaling=RopeScaling.YARN,
                    factor=float(params["factor"]),
                    original_max_position_embeddings=int(
                        params.get("original_max_position_embeddings")
                        or text.get("max_position_embeddings")),
                    beta_fast=float(params.get("beta_fast") or 32.0),
                    beta_slow=float(params.get("beta_slow") or 1.0),
                    mscale=params.get("mscale"),
                    mscale_all_dim=params.get("mscale_all_dim"),
                    attention_factor=params.get("attention_factor"),
                    truncate=bool(params.get("truncate", True)),
                    **common,
                )
            case _:
                raise NotImplementedError(
                    f"rope_type {rope_type!r} is not supported (supported: default, linear, yarn)")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """One Qwen3-family attention layer over a paged KV cache."""

    hidden_size: int  # H, model width
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA: divides num_heads; MQA: 1)
    head_dim: int  # D per head
    qkv_bias: bool = False  # biases on q/k/v projections (Qwen2)
    o_bias: bool = False  # bias on the output projection
    qk_norm: bool = True  # per-head RMSNorm over head_dim on q and k before RoPE (Qwen3)
    norm_style: NormStyle = NormStyle.SCALE  # RMSNorm weight convention for the qk norms
    rms_norm_eps: float = 1e-6  # epsilon of the qk norms
    rope: RopeConfig = RopeConfig()  # rotary embedding
    scale: float | None = None  # softmax scale override (None: head_dim ** -0.5)
    sliding_window: int | None = None  # attend to the last W positions only (None: all)
    logit_softcap: float | None = None  # logits = c * tanh(logits / c)
    sinks: bool = False  # per-head learned sink logit in the softmax (gpt-oss)
    output_gate: OutputGate = OutputGate.NONE  # gate on the attention output (Qwen3-Next)
    weight_format: Format = Format.BF16  # storage format of q/k/v/o weights
    fp8_block: tuple[int, int] = (128, 128)  # FP8_BLOCK weight block (b0 along N, b1 along K)
    fp8_kv_calibration_tokens: int = 0  # FP8 KV: 0: scale = amax/448 per token per head; N > 0:
    # per-head scales calibrated online on the first N tokens written, then frozen (saturating)

    def __post_init__(self) -> None:
        _coerce_enums(self)
        name = "AttentionConfig"
        _positive(self, "hidden_size", "num_heads", "num_kv_heads", "head_dim")
        _non_negative(self, "fp8_kv_calibration_tokens")
        b0, b1 = self.fp8_block
        if not (isinstance(b0, int) and isinstance(b1, int) and b0 > 0 and b1 > 0):
            raise _fail(name, "fp8_block", self.fp8_block, "must be two positive ints")
        if self.num_heads % self.num_kv_heads:
            raise _fail(name, "num_kv_heads", self.num_kv_heads,
                        f"must divide num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise _fail(name, "head_dim", self.head_dim, "must be even (RoPE rotates pairs)")
        if self.sliding_window is not None:
            _positive(self, "sliding_window")
        for field in ("scale", "logit_softcap"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise _fail(name, field, value, "must be > 0 or None")
        if not isinstance(self.rope, RopeConfig):
            raise TypeError(f"AttentionConfig.rope must be a RopeConfig, got {type(self.rope)}")
        if self.rope.mrope_section is not None:
            half = self.rope.rotary_dim(self.head_dim) // 2
            if sum(self.rope.mrope_section) != half:
                raise _fail(name, "rope.mrope_section", self.rope.mrope_section,
                            f"must sum to rotary_dim/2 = {half}")
        _check_block(name, "weight_format", self.weight_format, "hidden_size", self.hidden_size)
        _check_block(name, "weight_format", self.weight_format,
                     "num_heads*head_dim", self.num_heads * self.head_dim)

    @property
    def q_per_kv(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.num_heads // self.num_kv_heads

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim**-0.5

    @property
    def q_proj_rows(self) -> int:
        """Output rows of q_proj: per head ``[q_h (D)]``, ``[q_h (D) | gate_h (D)]``
        (ELEMENTWISE, Qwen3-Next) or ``[q_h (D) | gate_h (1)]`` (HEADWISE_*)."""
        match self.output_gate:
            case OutputGate.NONE:
                return self.num_heads * self.head_dim
            case OutputGate.ELEMENTWISE:
                return 2 * self.num_heads * self.head_dim
            case OutputGate.HEADWISE_SIGMOID | OutputGate.HEADWISE_SOFTPLUS:
                return self.num_heads * (self.head_dim + 1)

    def replace(self, **changes: Any) -> AttentionConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any]) -> AttentionConfig:
        """The (full-)attention layer config from an HF ``config.json`` dict.

        ``weight_format`` stays BF16: quantization configs exclude modules (attention is often
        kept unquantized), so the loader takes each weight's format from the stored tensors
        (``atlas_jax.checkpoint.load_attention_layer``). An FP8 ``quantization_config`` sets
        ``fp8_block`` (its ``weight_block_size``)."""
        text = _text_config(d)
        model_type = _model_type(d)
        parse = _ATTENTION_PARSERS.get(model_type)
        if parse is None:
            reason = _ATTENTION_UNSUPPORTED.get(model_type)
            if reason:
                raise NotImplementedError(
                    f"model_type {model_type!r}: {reason}; supported attention model "
                    f"types: {', '.join(sorted(_ATTENTION_PARSERS))}")
            raise _unknown_model_type(d, _ATTENTION_PARSERS)
        cfg = parse(_Keys(text))
        q = _quantization_config(d)
        if q.get("quant_method") == "fp8":
            cfg = cfg.replace(fp8_block=_fp8_block(q))
        return cfg


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Which implementation each op uses, and kernel tunables (None: the heuristic decides)."""

    grouped_matmul: Backend = Backend.AUTO  # expert matmuls: "auto" | "pallas" | "xla"
    paged_attention: Backend = Backend.AUTO  # attention over the paged cache
    router: Backend = Backend.AUTO  # routing's top-k and weights: "auto" | "pallas" | "xla"
    moe_path: MoEPath = MoEPath.AUTO  # "auto" | "decode" | "prefill" variant of moe_forward
    decode_max_tokens: int = 64  # "auto" takes the decode path for T * k <= this * k
    gmm_block_m: int | None = None  # grouped matmul rows per tile (engine _M256 -> 256)
    gmm_block_n: int | None = None  # grouped matmul output columns per tile
    gmm_block_k: int | None = None  # grouped matmul K step (engine _K32 -> 32)
    gmm_gate_up_block_m: int | None = None  # rows per tile of the gate_up matmul (NVFP4 M128)
    gmm_num_stages: int | None = None  # software pipelining depth (engine W8A16_PIPELINED)
    gmm_kernel: GmmKernel = GmmKernel.AUTO  # Pallas grouped matmul: "auto" | "triton" | "mosaic"
    decode_kernel: GmmKernel = GmmKernel.AUTO  # Pallas MoE decode: "auto" | "triton" | "mosaic"
    attn_gqa_pack: bool = True  # all query heads of one KV head in one program (decode: must)
    attn_num_splits: int | None = None  # decode split-K over pages (None: heuristic)
    attn_block_pages: int | None = None  # pages per decode / prefill program step (None: heur.)
    attn_decode_kernel: GmmKernel = GmmKernel.AUTO  # paged decode: "auto" | "triton" | "mosaic"

    def __post_init__(self) -> None:
        _coerce_enums(self)
        _positive(self, "decode_max_tokens")
        for field in ("gmm_block_m", "gmm_block_n", "gmm_block_k", "gmm_gate_up_block_m",
                      "gmm_num_stages", "attn_num_splits", "attn_block_pages"):
            value = getattr(self, field)
            if value is None:
                continue
            _positive(self, field)
            if field.startswith("gmm_block") and value & (value - 1):
                raise _fail("KernelConfig", field, value, "must be a power of two")

    def replace(self, **changes: Any) -> KernelConfig:
        return dataclasses.replace(self, **changes)




# ----------------------------------------------------------------------------------------------
# HF config.json parsing
# ----------------------------------------------------------------------------------------------


class _Keys:
    """A config.json dict whose missing required keys raise a clear KeyError-like ValueError."""

    def __init__(self, d: Mapping[str, Any]):
        self.d = d

    def __getitem__(self, key: str) -> Any:
        if key not in self.d:
            raise ValueError(
                f"config.json of model_type {self.d.get('model_type')!r} lacks key {key!r}")
        return self.d[key]

    def first(self, *keys: str) -> Any:
        """The first of ``keys`` present (config.json spellings differ across versions)."""
        for key in keys:
            if self.d.get(key) is not None:
                return self.d[key]
        raise ValueError(f"config.json of model_type {self.d.get('model_type')!r} lacks key "
                         f"{' / '.join(map(repr, keys))}")

    def get(self, key: str, default: Any = None) -> Any:
        value = self.d.get(key, default)
        return default if value is None else value


def _text_config(d: Mapping[str, Any]) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise TypeError(f"from_hf_config expects a dict (config.json), got {type(d).__name__}")
    return d.get("text_config") or d


def _model_type(d: Mapping[str, Any]) -> str:
    """The model_type of a config.json; a multimodal wrapper's (gemma4) over its text part's."""
    return d.get("model_type") or _text_config(d).get("model_type", "")


def _unknown_model_type(d: Mapping[str, Any], parsers: Mapping[str, Any] | None = None):
    supported = ", ".join(sorted(parsers if parsers is not None else _MOE_PARSERS))
    return ValueError(f"unsupported model_type {_model_type(d)!r}; supported: {supported}")


QUANT_METHODS = ("modelopt", "compressed-tensors", "fp8", "mxfp4")


def _quantization_config(d: Mapping[str, Any]) -> Mapping[str, Any]:
    return d.get("quantization_config") or _text_config(d).get("quantization_config") or {}


def _fp8_block(q: Mapping[str, Any]) -> tuple[int, int]:
    """The FP8 weight block of an ``fp8`` quantization_config (default 128 x 128)."""
    return tuple(q.get("weight_block_size") or (128, 128))


def _format_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """expert_format (and fp8_block) from ``quantization_config``; {} when unquantized."""
    q = _quantization_config(d)
    if not q:
        return {}
    method = q.get("quant_method")
    match method:
        case "modelopt":
            algo = q.get("quant_algo") or (q.get("quantization") or {}).get("quant_algo")
            if algo != "NVFP4":
                raise NotImplementedError(f"modelopt quant_algo {algo!r} (supported: 'NVFP4')")
            return {"expert_format": Format.NVFP4}
        case "compressed-tensors":
            fmt = q.get("format")
            if fmt != "nvfp4-pack-quantized":
                raise NotImplementedError(
                    f"compressed-tensors format {fmt!r} (supported: 'nvfp4-pack-quantized')")
            return {"expert_format": Format.NVFP4}
        case "fp8":
            return {"expert_format": Format.FP8_BLOCK, "fp8_block": _fp8_block(q)}
        case "mxfp4":
            return {"expert_format": Format.MXFP4}
        case _:
            raise ValueError(
                f"unsupported quant_method {method!r}; supported: {', '.join(QUANT_METHODS)}")


def _model_router_dtype(k: _Keys) -> str:
    """The checkpoint's dtype, for architectures whose HF router does not upcast to fp32."""
    dtype = k.get("dtype") or k.get("torch_dtype") or "float32"
    return dtype if dtype in _ROUTER_DTYPES else "float32"


def _qwen_moe(k: _Keys, layer: int | None) -> MoEConfig:
    shared = k.get("shared_expert_intermediate_size", 0)
    return MoEConfig(
        hidden_size=k["hidden_size"],
        intermediate_size=k["moe_intermediate_size"],
        num_experts=k.first("num_experts", "num_local_experts"),
        top_k=k["num_experts_per_tok"],
        norm_topk_prob=bool(k.get("norm_topk_prob", False)),
        shared_intermediate_size=shared,
        shared_expert_gate=bool(shared),
        rms_norm_eps=k.get("rms_norm_eps", 1e-6),
    )


def _mixtral(k: _Keys, layer: int | None) -> MoEConfig:
    return MoEConfig(
        hidden_size=k["hidden_size"],
        intermediate_size=k["intermediate_size"],
        num_experts=k.first("num_local_experts", "num_experts"),
        top_k=k["num_experts_per_tok"],
        norm_topk_prob=True,
        rms_norm_eps=k.get("rms_norm_eps", 1e-5),
    )


def _deepseek_v3(k: _Keys, layer: int | None) -> MoEConfig:
    return MoEConfig(
        hidden_size=k["hidden_size"],
        intermediate_size=k["moe_intermediate_size"],
        num_experts=k["n_routed_experts"],
        top_k=k["num_experts_per_tok"],
        scoring=RouterScoring.SIGMOID,
        norm_topk_prob=bool(k.get("norm_topk_prob", True)),
        norm_eps=1e-20,
        routed_scaling_factor=float(k.get("routed_scaling_factor", 1.0)),
        n_group=k.get("n_group", 1),
        topk_group=k.get("topk_group", 1),
        selection_bias=True,
        shared_intermediate_size=k.get("n_shared_experts", 0) * k["moe_intermediate_size"],
        rms_norm_eps=k.get("rms_norm_eps", 1e-6),
    )


def _gpt_oss(k: _Keys, layer: int | None) -> MoEConfig:
    return MoEConfig(
        hidden_size=k["hidden_size"],
        intermediate_size=k["intermediate_size"],
        num_experts=k["num_local_experts"],
        top_k=k["num_experts_per_tok"],
        scoring=RouterScoring.TOPK_SOFTMAX,
        router_bias=True,
        router_dtype=_model_router_dtype(k),  # transformers routes in the model dtype here
        activation=Activation.GPT_OSS,
        swiglu_limit=float(k.get("swiglu_limit", 7.0)),
        gate_up_layout=GateUpLayout.INTERLEAVED,
        expert_bias=True,
        rms_norm_eps=k.get("rms_norm_eps", 1e-5),
    )


def _longcat_flash(k: _Keys, layer: int | None) -> MoEConfig:
    return MoEConfig(
        hidden_size=k["hidden_size"],
        intermediate_size=k["expert_ffn_hidden_size"],
        num_experts=k["n_routed_experts"],
        top_k=k["moe_topk"],
        norm_topk_prob=False,
        routed_scaling_factor=float(k.get("routed_scaling_factor", 1.0)),
        selection_bias=True,
        num_zero_experts=k.get("zero_expert_num", 0),
        rms_norm_eps=k.get("rms_norm_eps", 1e-5),
    )


def _minimax_m2(k: _Keys, layer: int | None) -> MoEConfig:
    return MoEConfig(
        hidden_size=k["hidden_size"],
        intermediate_size=k["intermediate_size"],
        num_experts=k["num_local_experts"],
        top_k=k["num_experts_per_tok"],
        scoring=RouterScoring.SIGMOID,
        norm_topk_prob=True,
        selection_bias=bool(k.get("use_routing_bias", True)),
        rms_norm_eps=k.get("rms_norm_eps", 1e-6),
    )


def _deepseek_v4(k: _Keys, layer: int | None) -> MoEConfig:
    # transformers names each layer's MLP kind; DeepSeek's own config counts leading hash layers.
    kinds = k.get("mlp_layer_types")
    if layer is None:
        hashed = False
    elif kinds:
        hashed = kinds[layer] == "hash_moe"
    else:
        hashed = layer < k.get("num_hash_layers", 0)
    return MoEConfig(
        hidden_size=k["hidden_size"],
        intermediate_size=k["moe_intermediate_size"],
        num_experts=k["n_routed_experts"],
        top_k=k["num_experts_per_tok"],
        scoring=RouterScoring.SQRT_SOFTPLUS,
        norm_topk_prob=True,
        norm_eps=1e-20,
        routed_scaling_factor=float(k.get("routed_scaling_factor", 1.0)),
        selection_bias=not hashed,
        hash_vocab_size=k["vocab_size"] if hashed else 0,
        swiglu_limit=k.get("swiglu_limit") or None,  # transformers clamps the shared expert too
        # The shared expert's width is moe_intermediate_size, whatever n_shared_experts says.
        shared_intermediate_size=k["moe_intermediate_size"] if k.get("n_shared_experts") else 0,
        router_dtype=_model_router_dtype(k),  # transformers routes in the model dtype here
        rms_norm_eps=k.get("rms_norm_eps", 1e-6),
    )


def _gemma4(k: _Keys, layer: int | None) -> MoEConfig:
    if not k.get("enable_moe_block", False):
        raise ValueError("gemma4 config has enable_moe_block false: the model has no MoE layer")
    return MoEConfig(
        hidden_size=k["hidden_size"],
        intermediate_size=k["moe_intermediate_size"],
        num_experts=k["num_experts"],
        top_k=k["top_k_experts"],
        norm_topk_prob=True,
        gemma_router=True,
        per_expert_scale=True,
        pre_expert_norm=True,
        activation=Activation.GELU_TANH,
        rms_norm_eps=k.get("rms_norm_eps", 1e-6),
    )


_MOE_PARSERS: dict[str, Callable[[_Keys, int | None], MoEConfig]] = {
    "qwen3_moe": _qwen_moe,
    "qwen2_moe": _qwen_moe,
    "qwen3_next": _qwen_moe,
    "mixtral": _mixtral,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
    "longcat_flash": _longcat_flash,
    "minimax_m2": _minimax_m2,
    "deepseek_v4": _deepseek_v4,
    "gemma4": _gemma4,
}

SUPPORTED_MODEL_TYPES = tuple(sorted(_MOE_PARSERS))


def _head_dim(k: _Keys) -> int:
    return k.get("head_dim") or k["hidden_size"] // k["num_attention_heads"]


def _qwen_attention(k: _Keys) -> AttentionConfig:
    model_type = k.d.get("model_type")
    qwen2 = model_type == "qwen2_moe"  # Qwen2: qkv_bias (default on), o_proj never biased
    bias = bool(k.get("qkv_bias", True)) if qwen2 else bool(k.get("attention_bias", False))
    return AttentionConfig(
        hidden_size=k["hidden_size"],
        num_heads=k["num_attention_heads"],
        num_kv_heads=k.get("num_key_value_heads", k["num_attention_heads"]),
        head_dim=_head_dim(k),
        qkv_bias=bias,
        o_bias=bias and not qwen2,  # Qwen3 family: o_proj bias = attention_bias
        qk_norm=model_type in ("qwen3", "qwen3_moe", "qwen3_next"),
        norm_style=NormStyle.OFFSET if model_type == "qwen3_next" else NormStyle.SCALE,
        rms_norm_eps=k.get("rms_norm_eps", 1e-6),
        rope=RopeConfig.from_hf_config(k.d),
        sliding_window=k.get("sliding_window") if k.get("use_sliding_window", False) else None,
        output_gate=OutputGate.ELEMENTWISE if model_type == "qwen3_next" else OutputGate.NONE,
    )


def _mixtral_attention(k: _Keys) -> AttentionConfig:
    return AttentionConfig(
        hidden_size=k["hidden_size"],
        num_heads=k["num_attention_heads"],
        num_kv_heads=k.get("num_key_value_heads", k["num_attention_heads"]),
        head_dim=_head_dim(k),
        qk_norm=False,
        rms_norm_eps=k.get("rms_norm_eps", 1e-5),
        rope=RopeConfig.from_hf_config(k.d),
        sliding_window=k.get("sliding_window"),
    )


def _gpt_oss_attention(k: _Keys) -> AttentionConfig:
    return AttentionConfig(
        hidden_size=k["hidden_size"],
        num_heads=k["num_attention_heads"],
        num_kv_heads=k["num_key_value_heads"],
        head_dim=_head_dim(k),
        qkv_bias=bool(k.get("attention_bias", True)),
        o_bias=bool(k.get("attention_bias", True)),
        qk_norm=False,
        rms_norm_eps=k.get("rms_norm_eps", 1e-5),
        rope=RopeConfig.from_hf_config(k.d),
        sinks=True,
    )


_ATTENTION_PARSERS: dict[str, Callable[[_Keys], AttentionConfig]] = {
    "qwen3": _qwen_attention,
    "qwen3_moe": _qwen_attention,
    "qwen2_moe": _qwen_attention,
    "qwen3_next": _qwen_attention,
    "mixtral": _mixtral_attention,
    "gpt_oss": _gpt_oss_attention,
}

# MoE model types whose attention this library does not implement, with the reason.
_ATTENTION_UNSUPPORTED = {
    "deepseek_v3": "multi-head latent attention (MLA) is not Qwen3-style attention",
    "deepseek_v4": "its compressed/latent attention is not Qwen3-style attention",
    "longcat_flash": "multi-head latent attention (MLA) is not Qwen3-style attention",
    "gemma4": "Gemma-4 attention (sliding/global layer mix, value norm) is not implemented",
    "gemma4_text": "Gemma-4 attention (sliding/global layer mix, value norm) is not implemented",
    "minimax_m2": "MiniMax-M2 RMS-normalizes q and k over the whole projection (q_norm over "
                  "num_heads*head_dim, before the head reshape), not per head",
}
