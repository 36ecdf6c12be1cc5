"""aj.checkpoint.load_attention_layer: the transformers golden fixtures load as
``from_hf_tensors`` builds them and reproduce transformers; every projection is read in the
format it is stored in (not the one quantization_config names); per-layer types; clear errors."""

import json
import shutil
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import atlas_jax as aj
from atlas_jax._safetensors import SafetensorsFile, save_file
from atlas_jax.checkpoint import Checkpoint, CheckpointError
from atlas_jax.config import Format
from atlas_jax.quant import dequantize
from tests.test_attention import (
    FIXTURES,
    GOLDENS,
    load_golden,
    naive_layer,
    rand_x,
    rel,
    run_prefill,
)
from tests.test_checkpoint import fp8_linear, mxfp4_linear, nvfp4_linear

FP8_FIXTURE = Path(__file__).parent / "fixtures" / "moe_quantized" / "qwen3_moe_fp8"
PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")


def tree_np(p):
    return jax.tree.map(np.asarray, p)


def rewrite(src: Path, dst: Path, *, config=None, tensors=None, drop=()) -> Path:
    """A copy of the one-file HF directory ``src``: config.json updated with ``config``,
    tensors replaced / added from ``tensors``, names starting with any of ``drop`` removed."""
    shutil.copytree(src, dst)
    d = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**d, **(config or {})}))
    f = SafetensorsFile(dst / "model.safetensors")
    kept = {n: f.get(n) for n in f.names() if not n.startswith(tuple(drop))}
    save_file({**kept, **(tensors or {})}, dst / "model.safetensors")
    return dst


def attn_prefix(layer: int) -> str:
    return f"model.layers.{layer}.self_attn."


# ---------------------------------------------------------------------------------------------
# the transformers goldens
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GOLDENS)
def test_golden_fixture_loads_as_from_hf_tensors(name):
    ref, g, _ = load_golden(name)
    layer = int(g["layer"])
    ck = Checkpoint(FIXTURES / name)
    p = aj.checkpoint.load_attention_layer(ck, layer)
    assert p.config == ref.config and p.config.weight_format is Format.BF16
    chex.assert_trees_all_equal(tree_np(p), tree_np(ref))
    # Only that layer's attention tensors were read (the derived ``has`` is not needed).
    assert ck.tensors_read == sum(n.startswith(attn_prefix(layer)) for n in ck._where)
    y, _ = run_prefill(p, jnp.asarray(g["x"]))
    assert rel(y, g["y"]) < 1e-4


def test_fp8_checkpoint_keeps_its_bf16_attention():
    """An FP8 checkpoint written by ``atlas-jax quantize`` keeps attention unquantized (listed
    in modules_to_not_convert): it loads in its stored float dtype, fp8_block from the config."""
    for layer in (0, 1):
        p = aj.checkpoint.load_attention_layer(FP8_FIXTURE, layer)
        assert p.config.weight_format is Format.BF16 and p.config.fp8_block == (128, 128)
        for name in PROJS:
            qt = getattr(p, name)
            assert qt.format is Format.BF16 and qt.data.dtype == jnp.float32
        st = SafetensorsFile(FP8_FIXTURE / "model.safetensors")
        np.testing.assert_array_equal(np.asarray(p.q_proj.data),
                                      st.get(f"{attn_prefix(layer)}q_proj.weight"))
    y = aj.attention.prefill(p, rand_x(1, 3, h=p.config.hidden_size), *_cache_args(p, 1))[0]
    assert np.isfinite(np.asarray(y)).all()


def _cache_args(p, b):
    cache = aj.PagedKVCache.create(8, 4, p.config, dtype=aj.KVDtype.FLOAT32)
    return cache, jnp.arange(b * 2, dtype=jnp.int32).reshape(b, 2), jnp.zeros((b,), jnp.int32)


def _stored_attention(rng, packers: dict) -> tuple[dict, dict]:
    """q/k/v/o of the qwen3 fixture's shapes, each stored by ``packers[proj](rng, n, k)``:
    ({tensor name: array}, {proj: float64 dequantized weight})."""
    shapes = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64)}
    tensors, dense = {}, {}
    for proj, (n, k) in shapes.items():
        stored, dense[proj] = packers[proj](rng, n, k)
        tensors.update({f"{attn_prefix(0)}{proj}.{t}": a for t, a in stored.items()})
    return tensors, dense


def test_fp8_attention_loads_as_fp8_block(tmp_path):
    """E4M3 q/k/v/o + weight_scale_inv: FP8_BLOCK with the config's weight_block_size, values
    exact; the layer equals the float64 reference on the dequantized weights."""
    block = (16, 32)
    tensors, dense = _stored_attention(np.random.default_rng(0), dict.fromkeys(
        PROJS, lambda rng, n, k: fp8_linear(rng, n, k, block)))
    quant = {"quant_method": "fp8", "weight_block_size": list(block)}
    path = rewrite(FIXTURES / "qwen3", tmp_path / "fp8", config={"quantization_config": quant},
                   tensors=tensors, drop=[f"{attn_prefix(0)}{p}." for p in PROJS])
    p = aj.checkpoint.load_attention_layer(path, 0)
    assert p.config.weight_format is Format.FP8_BLOCK and p.config.fp8_block == block
    for name in PROJS:
        qt = getattr(p, name)
        assert qt.format is Format.FP8_BLOCK and qt.block == block
        np.testing.assert_array_equal(np.asarray(dequantize(qt), np.float64),
                                      dense[name].astype(np.float32))
    x = rand_x(2, 5, seed=3)
    y, _ = run_prefill(p, x)
    want = naive_layer(p, x)
    assert rel(y, want) < 1e-4


def test_each_projection_in_its_stored_format(tmp_path):
    """Formats are told apart per tensor: q ModelOpt NVFP4, k compressed-tensors NVFP4,
    v MXFP4, o float; the config's weight_format is q_proj's."""
    def float_linear(rng, n, k):
        w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
        return {"weight": w}, w.astype(np.float64)

    packers = {"q_proj": nvfp4_linear,
               "k_proj": lambda rng, n, k: nvfp4_linear(rng, n, k, inverted_global=True),
               "v_proj": mxfp4_linear,
               "o_proj": float_linear}
    tensors, dense = _stored_attention(np.random.default_rng(1), packers)
    path = rewrite(FIXTURES / "qwen3", tmp_path / "mixed", tensors=tensors,
                   drop=[f"{attn_prefix(0)}{p}." for p in PROJS])
    p = aj.checkpoint.load_attention_layer(path, 0)
    assert p.config.weight_format is Format.NVFP4
    assert [getattr(p, n).format for n in PROJS] == [Format.NVFP4, Format.NVFP4, Format.MXFP4,
                                                     Format.BF16]
    for name in PROJS:
        np.testing.assert_allclose(np.asarray(dequantize(getattr(p, name)), np.float64),
                                   dense[name].astype(np.float32), rtol=1e-6)
    x = rand_x(1, 4, seed=4)
    assert rel(run_prefill(p, x)[0], naive_layer(p, x)) < 1e-4
    # from_hf_tensors derives ``has`` from ``get`` when not given: same result.
    st = SafetensorsFile(path / "model.safetensors")
    cfg = aj.AttentionConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    chex.assert_trees_all_equal(tree_np(aj.attention.from_hf_tensors(st.get, attn_prefix(0),
                                                                      cfg)), tree_np(p))


# ---------------------------------------------------------------------------------------------
# layer types and errors
# ---------------------------------------------------------------------------------------------


def test_layer_types(tmp_path):
    """sliding_attention layers get the config's sliding_window, full_attention ones none;
    a linear-attention layer (Qwen3-Next) has no full attention to load."""
    sliding = rewrite(FIXTURES / "qwen3", tmp_path / "sliding", config={
        "layer_types": ["sliding_attention"], "sliding_window": 3, "use_sliding_window": True})
    assert aj.checkpoint.load_attention_layer(sliding, 0).config.sliding_window == 3
    full = rewrite(FIXTURES / "qwen3", tmp_path / "full", config={
        "layer_types": ["full_attention"], "sliding_window": 3, "use_sliding_window": True})
    assert aj.checkpoint.load_attention_layer(full, 0).config.sliding_window is None

    nxt = rewrite(FIXTURES / "qwen3_next", tmp_path / "next", config={
        "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]})
    ck = Checkpoint(nxt)
    with pytest.raises(ValueError, match=r"layer 0 has no full attention: layer_types\[0\] is "
                                         r"'linear_attention'.*full-attention layers: \[1\]"):
        aj.checkpoint.load_attention_layer(ck, 0)
    assert ck.tensors_read == 0
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.1.self_attn.q_proj.weight' "
                                              r"not found"):
        aj.checkpoint.load_attention_layer(ck, 1)

    bad = rewrite(FIXTURES / "qwen3", tmp_path / "bad_types", config={"layer_types": ["mamba"]})
    with pytest.raises(ValueError, match=r"layer_types\[0\] is 'mamba', expected"):
        aj.checkpoint.load_attention_layer(bad, 0)


def test_errors(tmp_path):
    with pytest.raises(ValueError, match=r"layer 1 out of range: the model has 1 layers"):
        aj.checkpoint.load_attention_layer(FIXTURES / "qwen3", 1)
    with pytest.raises(ValueError, match=r"layer -1 out of range"):
        aj.checkpoint.load_attention_layer(FIXTURES / "qwen3", -1)

    heads = rewrite(FIXTURES / "qwen3", tmp_path / "heads", config={"num_key_value_heads": 4})
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.: checkpoint disagrees with "
                                         r"config.json: AttentionParams.k_proj: expected shape "
                                         r"\(64, 64\), got \(32, 64\)"):
        aj.checkpoint.load_attention_layer(heads, 0)

    missing = rewrite(FIXTURES / "qwen3", tmp_path / "missing",
                      drop=[f"{attn_prefix(0)}k_norm."])
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.self_attn.k_norm.weight' "
                                              r"not found in .*missing"):
        aj.checkpoint.load_attention_layer(missing, 0)

    e4m3 = np.zeros((32, 64), ml_dtypes.float8_e4m3fn)  # FP8 without a block scale
    per_tensor = rewrite(FIXTURES / "qwen3", tmp_path / "per_tensor",
                         tensors={f"{attn_prefix(0)}k_proj.weight": e4m3})
    with pytest.raises(NotImplementedError, match=r"k_proj.weight is float8_e4m3fn without "
                                                  r".*k_proj.weight_scale_inv"):
        aj.checkpoint.load_attention_layer(per_tensor, 0)

    for model_type, reason in (("deepseek_v3", "multi-head latent attention"),
                               ("minimax_m2", "over the whole projection")):
        other = rewrite(FIXTURES / "qwen3", tmp_path / model_type,
                        config={"model_type": model_type})
        with pytest.raises(NotImplementedError, match=reason):
            aj.checkpoint.load_attention_layer(other, 0)
