"""ops.grouped_matmul: the "pallas" implementation (interpret mode on CPU) equals the "xla"
reference for every format and epilogue, and moe_forward's prefill path runs through it."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import atlas_jax as aj
from atlas_jax import ops
from atlas_jax.config import Activation, Format, GateUpLayout
from atlas_jax.ops.activation import GateUp

XLA = aj.KernelConfig(grouped_matmul="xla")
PALLAS = aj.KernelConfig(grouped_matmul="pallas")


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def inputs(fmt, m=50, n=64, k=64, g=4, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = aj.quant.quantize(jax.random.normal(kw, (g, n, k)) * k**-0.5, fmt,
                          block_size=(32, 32) if fmt is Format.FP8_BLOCK else None)
    gs = jnp.array([13, 0, 30, 5], jnp.int32)  # an empty group, 2 padding rows
    return x, w, gs


@pytest.mark.parametrize("fmt", list(Format))
@pytest.mark.parametrize("epilogue", [
    None,
    GateUp(Activation.SILU),
    GateUp(Activation.SILU, limit=0.5),  # DeepSeek-V4 clamp: kernel matmul + jnp activation
    GateUp(Activation.GELU_TANH),
    GateUp(Activation.GPT_OSS, GateUpLayout.INTERLEAVED, limit=0.5),
], ids=["plain", "silu", "silu_clamp", "gelu", "gpt_oss"])
def test_pallas_equals_reference(fmt, epilogue):
    x, w, gs = inputs(fmt)
    bias = jax.random.normal(jax.random.key(3), (4, 64)) * 0.1
    want = ops.grouped_matmul(x, w, gs, bias=bias, epilogue=epilogue, kernels=XLA)
    got = ops.grouped_matmul(x, w, gs, bias=bias, epilogue=epilogue, kernels=PALLAS)
    chex.assert_shape(got, (50, 32 if epilogue else 64))
    chex.assert_type(got, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got)[48:], 0.0)  # padding rows
    assert rel_err(got[:48], want[:48]) < 1e-2


def test_tile_overrides_reach_the_kernel():
    x, w, gs = inputs(Format.NVFP4)
    k = aj.KernelConfig(grouped_matmul="pallas", gmm_block_m=16, gmm_block_n=32, gmm_block_k=32,
                        gmm_num_stages=2)
    want = ops.grouped_matmul(x, w, gs, kernels=XLA)
    assert rel_err(ops.grouped_matmul(x, w, gs, kernels=k)[:48], want[:48]) < 1e-2


def test_errors():
    x, w, gs = inputs(Format.BF16)
    with pytest.raises(ValueError, match=r"x has K=32, w expects K=64"):
        ops.grouped_matmul(x[:, :32], w, gs)
    with pytest.raises(ValueError, match=r"group_sizes must be \[4\]"):
        ops.grouped_matmul(x, w, gs[:3])
    with pytest.raises(TypeError, match="w must be a QTensor"):
        ops.grouped_matmul(x, jnp.ones((4, 64, 64)), gs)
    with pytest.raises(ValueError, match=r"bias must be \[4, 64\]"):
        ops.grouped_matmul(x, w, gs, bias=jnp.ones((4, 32)))


@pytest.mark.parametrize("fmt", [Format.BF16, Format.NVFP4])
def test_moe_forward_prefill_through_pallas(fmt):
    cfg = aj.MoEConfig(hidden_size=64, intermediate_size=32, num_experts=8, top_k=2,
                       expert_format=fmt, shared_intermediate_size=32)
    p = aj.moe.init_params(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(1), (24, 64), jnp.bfloat16)
    want = aj.moe_forward(p, x, kernels=XLA.replace(moe_path="prefill"))
    got = aj.moe_forward(p, x, kernels=PALLAS.replace(moe_path="prefill"))
    assert rel_err(got, want) < 2e-2


MOSAIC = PALLAS.replace(gmm_kernel="mosaic")


@pytest.mark.parametrize("epilogue", [None, GateUp(Activation.SILU)], ids=["plain", "silu"])
def test_mosaic_kernel_equals_reference(epilogue):
    """gmm_kernel="mosaic" runs the Mosaic GPU kernel (its interpreter on CPU)."""
    x, w, gs = inputs(Format.BF16, n=128 if epilogue else 64)
    want = ops.grouped_matmul(x, w, gs, epilogue=epilogue, kernels=XLA)
    got = ops.grouped_matmul(x, w, gs, epilogue=epilogue, kernels=MOSAIC)
    chex.assert_shape(got, (50, 64))
    chex.assert_type(got, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got)[48:], 0.0)  # padding rows
    assert rel_err(got[:48], want[:48]) < 1e-2


def test_mosaic_kernel_unsupported_raises():
    x, w, gs = inputs(Format.NVFP4)
    with pytest.raises(NotImplementedError, match="takes BF16 weights, got nvfp4"):
        ops.grouped_matmul(x, w, gs, kernels=MOSAIC)
    x, w, gs = inputs(Format.BF16)
    with pytest.raises(NotImplementedError, match="no bias epilogue"):
        ops.grouped_matmul(x, w, gs, bias=jnp.ones((4, 64)), kernels=MOSAIC)
    # "auto" never picks the Mosaic kernel off an sm_90 GPU (here: interpret mode) and so runs
    # the Triton kernel, which takes a bias.
    auto = ops.grouped_matmul(x, w, gs, bias=jnp.ones((4, 64)), kernels=PALLAS)
    chex.assert_shape(auto, (50, 64))


def test_auto_kernel_choice(monkeypatch):
    """gmm_kernel="auto" on an (emulated) sm_90 GPU: Mosaic for what it supports, Triton for
    quantized weights, a bias, a Triton tile override, or another GPU generation."""
    import importlib

    gm = importlib.import_module("atlas_jax.ops.grouped_matmul")  # the module, not the function
    pk = importlib.import_module("pallas_kernels.grouped_matmul")

    monkeypatch.setattr(gm, "interpret_mode", lambda: False)
    monkeypatch.setattr(pk, "device_compute_capability", lambda: (9, 0))
    x, w, _ = inputs(Format.BF16)
    xq, wq, _ = inputs(Format.NVFP4)
    assert gm._use_mosaic(x, w, None, None, PALLAS)
    x2, w2, _ = inputs(Format.BF16, n=128)  # I = 64: Mosaic's f32 epilogue tile fits
    assert gm._use_mosaic(x2, w2, None, GateUp(Activation.SILU), PALLAS)
    assert not gm._use_mosaic(x, w, None, GateUp(Activation.SILU), PALLAS)  # I = 32: it does not
    assert not gm._use_mosaic(xq, wq, None, None, PALLAS)
    assert not gm._use_mosaic(x, w, jnp.ones((4, 64)), None, PALLAS)
    assert not gm._use_mosaic(x, w, None, None, PALLAS.replace(gmm_block_m=64))
    assert not gm._use_mosaic(x, w, None, None, PALLAS.replace(gmm_kernel="triton"))
    assert gm._use_mosaic(xq, wq, None, None, MOSAIC)  # explicit: raises later, with the reason
    monkeypatch.setattr(pk, "device_compute_capability", lambda: (12, 1))  # GB10
    assert not gm._use_mosaic(x, w, None, None, PALLAS)
