"""Plain-``jnp`` reference of the grouped matmul, float32-accumulating.

``out[M, N] = x[M, K] @ W[g]^T`` for the rows of group ``g``, where the rows of ``x`` are sorted by
group and ``group_sizes[g]`` counts them. Rows past ``sum(group_sizes)`` are padding and come out
as 0. Group boundaries are clamped to ``[0, M]`` (a negative size counts as 0, rows past ``M`` do
not exist); the kernel follows the same rule.

The reference dequantizes the whole expert stack to float32 (fine for a reference, never for the
decode path), runs ``jax.lax.ragged_dot`` and applies the same epilogue as the kernel: NVFP4
global scales (part of the dequantization), per-group bias, gated activation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul.config import (
    FP8_ACT_GROUP,
    FP8_E4M3_MAX,
    MXFP4_GROUP,
    NVFP4_GROUP,
    Activation,
    ActivationQuant,
    GateUpLayout,
    WeightFormat,
)

# E2M1 magnitudes of codes 0..7; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


def e2m1_to_f32(codes: jax.Array) -> jax.Array:
    """E2M1 codes (any int dtype, values 0..15) -> float32 by table lookup."""
    codes = codes.astype(jnp.int32)
    mag = jnp.asarray(E2M1_VALUES, jnp.float32)[codes & 7]
    return jnp.where(codes & 8, -mag, mag)


def unpack_fp4(packed: jax.Array) -> jax.Array:
    """[..., K//2] uint8, low nibble = even k -> [..., K] float32 E2M1 values."""
    lo = e2m1_to_f32(packed & 0xF)
    hi = e2m1_to_f32(packed >> 4)
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e8m0_to_f32(bits: jax.Array) -> jax.Array:
    """Raw E8M0 bits (uint8) -> 2^(bits - 127) as float32."""
    return jnp.exp2(bits.astype(jnp.float32) - 127.0)


def dequantize_weights(
    w: jax.Array,
    fmt: WeightFormat,
    *,
    scale: jax.Array | None = None,
    global_scale: jax.Array | None = None,
    block_size: tuple[int, int] = (128, 128),
) -> jax.Array:
    """Any supported weight layout -> float32 ``[G, N, K]``."""
    fmt = WeightFormat.coerce(fmt)
    match fmt:
        case WeightFormat.BF16:
            return w.astype(jnp.float32)
        case WeightFormat.FP8_BLOCK:
            b0, b1 = block_size
            _, n, k = w.shape
            s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), b0, axis=1), b1, axis=2)
            return w.astype(jnp.float32) * s[:, :n, :k]  # [G, N, K]
        case WeightFormat.NVFP4:
            vals = unpack_fp4(w)  # [G, N, K]
            s = jnp.repeat(scale.astype(jnp.float32), NVFP4_GROUP, axis=-1)
            g = global_scale.astype(jnp.float32)
            g = g.reshape(g.shape[0], -1)  # [G, R]
            g = jnp.repeat(g, w.shape[1] // g.shape[1], axis=1)  # [G, N]
            return vals * s * g[:, :, None]
        case WeightFormat.MXFP4:
            vals = unpack_fp4(w)
            return vals * jnp.repeat(e8m0_to_f32(scale), MXFP4_GROUP, axis=-1)


def rounded(x: jax.Array, dtype) -> jax.Array:
    """``x`` rounded to ``dtype`` and back to float32, the rounding kept under XLA's GPU
    compiler: with ``xla_allow_excess_precision`` (on by default) it removes float convert
    chains inside one program (``SimplifyFPConversions``: f32 -> bf16 -> f32 and f32 -> e4m3 ->
    f32 become nothing), so a reference that rounds an intermediate the way a kernel stores it
    would silently skip the rounding on the GPU. An optimization barrier between the two
    converts keeps both."""
    return jax.lax.optimization_barrier(x.astype(dtype)).astype(jnp.float32)


def quantize_activations_fp8(
    x: jax.Array, *, group_size: int = FP8_ACT_GROUP
) -> tuple[jax.Array, jax.Array]:
    """Per token, per ``group_size`` of K: ``scale = amax / 448``, ``q = e4m3(x / scale)``.

    Returns ``(q [M, K] float8_e4m3fn, scale [M, cdiv(K, group_size)] float32)``; an all-zero
    group gets scale 1 (its values quantize to 0 either way).
    """
    m, k = x.shape
    ng = -(-k // group_size)
    xf = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, ng * group_size - k)))
    xg = xf.reshape(m, ng, group_size)
    amax = jnp.max(jnp.abs(xg), axis=-1)  # [M, ng]
    scale = jnp.where(amax > 0, amax / FP8_E4M3_MAX, 1.0)
    q = jnp.clip(xg / scale[..., None], -FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.reshape(m, ng * group_size)[:, :k].astype(jnp.float8_e4m3fn)
    return q, scale


def dequantize_activations_fp8(
    q: jax.Array, scale: jax.Array, *, group_size: int = FP8_ACT_GROUP
) -> jax.Array:
    k = q.shape[1]
    q = jax.lax.optimization_barrier(q)  # keeps a quantize -> dequantize chain (``rounded``)
    return q.astype(jnp.float32) * jnp.repeat(scale.astype(jnp.float32), group_size, axis=1)[:, :k]


def split_gate_up(y: jax.Array, layout: GateUpLayout) -> tuple[jax.Array, jax.Array]:
    """[..., 2I] -> gate [..., I], up [..., I]."""
    match GateUpLayout.coerce(layout):
        case GateUpLayout.CONCATENATED:
            half = y.shape[-1] // 2
            return y[..., :half], y[..., half:]
        case GateUpLayout.INTERLEAVED:
            return y[..., 0::2], y[..., 1::2]


def gated_activation(
    gate: jax.Array,
    up: jax.Array,
    activation: Activation,
    *,
    alpha: float = GPT_OSS_ALPHA,
    limit: float = GPT_OSS_LIMIT,
) -> jax.Array:
    """``act(gate) * up`` in float32 (the epilogue the kernel fuses)."""
    gate = gate.astype(jnp.float32)
    up = up.astype(jnp.float32)
    match Activation.coerce(activation):
        case Activation.SILU:
            return jax.nn.silu(gate) * up
        case Activation.GELU_TANH:
            return jax.nn.gelu(gate, approximate=True) * up
        case Activation.GPT_OSS:
            g = jnp.minimum(gate, limit)
            u = jnp.clip(up, -limit, limit)
            return (u + 1.0) * g * jax.nn.sigmoid(alpha * g)


def group_ids_of_rows(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """[M] int32 group of each row; ``G`` for padding rows past ``sum(group_sizes)``."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), num_rows)
    return jnp.sum(ends[None, :] <= jnp.arange(num_rows, dtype=jnp.int32)[:, None], axis=1)


@functools.partial(
    jax.jit,
    static_argnames=(
        "fmt",
        "activation",
        "gate_up_layout",
        "act_quant",
        "block_size",
        "alpha",
        "limit",
        "out_dtype",
    ),
)
def grouped_matmul_reference(
    x: jax.Array,  # [M, K]
    w: jax.Array,  # [G, N, K] (BF16, FP8_BLOCK) | [G, N, K//2] u8 (NVFP4, MXFP4)
    group_sizes: jax.Array,  # [G] int32
    *,
    fmt: WeightFormat,
    scale: jax.Array | None = None,
    global_scale: jax.Array | None = None,  # [G, R] or [G] (NVFP4)
    bias: jax.Array | None = None,  # [G, N]
    x_scale: jax.Array | None = None,  # [M, cdiv(K, 128)] when x is already e4m3
    activation: Activation | None = None,
    gate_up_layout: GateUpLayout = GateUpLayout.CONCATENATED,
    act_quant: ActivationQuant = ActivationQuant.NONE,
    block_size: tuple[int, int] = (128, 128),
    alpha: float = GPT_OSS_ALPHA,
    limit: float = GPT_OSS_LIMIT,
    out_dtype=jnp.float32,
) -> jax.Array:
    """Reference of ``grouped_matmul``: [M, N], or [M, N // 2] with a gated ``activation``."""
    m = x.shape[0]
    num_groups = w.shape[0]
    wf = dequantize_weights(w, fmt, scale=scale, global_scale=global_scale, block_size=block_size)

    if x.dtype == jnp.float8_e4m3fn:
        xf = dequantize_activations_fp8(x, x_scale)
    elif ActivationQuant.coerce(act_quant) is ActivationQuant.FP8:
        xf = dequantize_activations_fp8(*quantize_activations_fp8(x))
    else:
        xf = x.astype(jnp.float32)

    ids = group_ids_of_rows(group_sizes, m)  # [M]
    sizes = jnp.bincount(ids, length=num_groups + 1)[:num_groups].astype(jnp.int32)
    y = jax.lax.ragged_dot(
        xf,
        jnp.swapaxes(wf, 1, 2),  # [G, K, N]
        sizes,
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )  # [M, N]
    if bias is not None:
        y = y + bias.astype(jnp.float32)[jnp.minimum(ids, num_groups - 1)]
    if activation is not None:
        gate, up = split_gate_up(y, gate_up_layout)
        y = gated_activation(gate, up, activation, alpha=alpha, limit=limit)
    y = jnp.where((ids < num_groups)[:, None], y, 0.0)
    return y.astype(out_dtype)
