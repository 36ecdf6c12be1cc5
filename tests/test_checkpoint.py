"""Checkpoint loading: every stored format (written by an independent numpy packer here),
sharded directories, lazy per-layer reads, clear failures, and the quantize command."""

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import atlas_jax as aj
from atlas_jax import cli
from atlas_jax._safetensors import SafetensorsFile, save_file
from atlas_jax.checkpoint import Checkpoint, CheckpointError
from atlas_jax.config import Format
from atlas_jax.quant import dequantize
from atlas_jax.quantize_checkpoint import quantize_checkpoint

H, I, E, K_TOP = 64, 32, 4, 2
FIXTURES = Path(__file__).parent / "fixtures" / "moe"
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])

CONFIG = {
    "model_type": "qwen3_moe", "hidden_size": H, "moe_intermediate_size": I,
    "num_experts": E, "num_experts_per_tok": K_TOP, "norm_topk_prob": True,
    "num_hidden_layers": 2, "mlp_only_layers": [0], "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": 32,
}


# ---------------------------------------------------------------------------------------------
# an independent numpy packer for each format: (stored tensors, dequantized float64 weight)
# ---------------------------------------------------------------------------------------------


def pack_nibbles(codes):
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def random_e4m3(rng, shape):
    """Positive E4M3 values (normal range), as ml_dtypes float8_e4m3fn."""
    return (2.0 ** rng.integers(-6, 4, shape) * rng.choice([1, 1.25, 1.5, 1.75], shape)
            ).astype(ml_dtypes.float8_e4m3fn)


def nvfp4_linear(rng, n, k, inverted_global=False):
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    scale = random_e4m3(rng, (n, k // 16))
    g = np.float32(rng.uniform(0.01, 0.1))
    stored = np.float32(1 / g)
    if inverted_global:  # the global that the checkpoint means is 1 / stored, in float32
        g = np.float32(1) / stored
    w = E2M1[codes] * np.repeat(scale.astype(np.float64), 16, axis=1) * np.float64(g)
    if inverted_global:
        return {"weight_packed": pack_nibbles(codes), "weight_scale": scale,
                "weight_global_scale": stored.reshape(1)}, w
    return {"weight": pack_nibbles(codes), "weight_scale": scale,
            "weight_scale_2": np.asarray(g, np.float32)}, w


def fp8_linear(rng, n, k, block=(128, 128)):
    q = rng.standard_normal((n, k)).astype(ml_dtypes.float8_e4m3fn)
    nb0, nb1 = -(-n // block[0]), -(-k // block[1])
    s = rng.uniform(0.5, 2.0, (nb0, nb1)).astype(np.float32)
    full = np.repeat(np.repeat(s, block[0], 0), block[1], 1)[:n, :k]
    return {"weight": q, "weight_scale_inv": s}, q.astype(np.float64) * full


def mxfp4_linear(rng, n, k):
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    scales = rng.integers(118, 130, (n, k // 32)).astype(np.uint8)
    w = E2M1[codes] * np.repeat(2.0 ** (scales.astype(np.float64) - 127), 32, axis=1)
    return {"weight_blocks": pack_nibbles(codes).reshape(n, k // 32, 16),
            "weight_scales": scales}, w


PACKERS = {
    "modelopt": (lambda rng, n, k: nvfp4_linear(rng, n, k),
                 {"quant_method": "modelopt", "quant_algo": "NVFP4"}),
    "compressed_tensors": (lambda rng, n, k: nvfp4_linear(rng, n, k, inverted_global=True),
                           {"quant_method": "compressed-tensors",
                            "format": "nvfp4-pack-quantized"}),
    "fp8": (lambda rng, n, k: fp8_linear(rng, n, k, (16, 32)),
            {"quant_method": "fp8", "weight_block_size": [16, 32]}),
    "mxfp4": (mxfp4_linear, {"quant_method": "mxfp4"}),
}
FORMAT_OF = {"modelopt": Format.NVFP4, "compressed_tensors": Format.NVFP4,
             "fp8": Format.FP8_BLOCK, "mxfp4": Format.MXFP4}


def write_model(path: Path, kind: str, *, shards: int = 1, seed: int = 0):
    """A 2-layer qwen3_moe directory (layer 0 dense, layer 1 MoE) with experts in ``kind``;
    returns the float64 dequantized expert weights {name: array}."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    tensors, dense = {}, {}
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.1  # noqa: E731
    tensors["model.embed_tokens.weight"] = f32(32, H)
    for layer in (0, 1):
        p = f"model.layers.{layer}."
        tensors[p + "self_attn.q_proj.weight"] = f32(64, H)
        tensors[p + "input_layernorm.weight"] = f32(H)
    for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        tensors[f"model.layers.0.mlp.{proj}.weight"] = f32(*shape)
    tensors["model.layers.1.mlp.gate.weight"] = f32(E, H)
    config = dict(CONFIG)
    for e in range(E):
        for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            name = f"model.layers.1.mlp.experts.{e}.{proj}"
            if kind == "bf16":
                w = f32(n, k)
                tensors[name + ".weight"], dense[name] = w, w.astype(np.float64)
                continue
            pack, _ = PACKERS[kind]
            stored, dense[name] = pack(rng, n, k)
            tensors.update({f"{name}.{t}": v for t, v in stored.items()})
    if kind != "bf16":
        config["quantization_config"] = PACKERS[kind][1]
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, path / "model.safetensors")
    else:
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i::shards]
            save_file({n: tensors[n] for n in part}, path / file)
            weight_map.update(dict.fromkeys(part, file))
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dense


def expected_stack(dense):
    gate = np.stack([dense[f"model.layers.1.mlp.experts.{e}.gate_proj"] for e in range(E)])
    up = np.stack([dense[f"model.layers.1.mlp.experts.{e}.up_proj"] for e in range(E)])
    down = np.stack([dense[f"model.layers.1.mlp.experts.{e}.down_proj"] for e in range(E)])
    return np.concatenate([gate, up], axis=1), down


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bf16", *PACKERS])
@pytest.mark.parametrize("shards", [1, 3])
def test_load_each_format_exactly(tmp_path, kind, shards):
    dense = write_model(tmp_path / kind, kind, shards=shards)
    p = aj.checkpoint.load_moe_layer(tmp_path / kind, 1)
    assert p.config.expert_format is (FORMAT_OF.get(kind, Format.BF16))
    assert p.gate_up.shape == (E, 2 * I, H) and p.down.shape == (E, H, I)
    gate_up, down = expected_stack(dense)
    np.testing.assert_array_equal(np.asarray(dequantize(p.gate_up), np.float64),
                                  gate_up.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(dequantize(p.down), np.float64),
                                  down.astype(np.float32))
    y = aj.moe_forward(p, jnp.ones((3, H)))
    assert y.shape == (3, H) and np.isfinite(np.asarray(y)).all()


def test_per_layer_load_reads_only_that_layer(tmp_path):
    write_model(tmp_path / "m", "modelopt", shards=2)
    ck = Checkpoint(tmp_path / "m")
    aj.checkpoint.load_moe_layer(ck, 1)
    # router + E experts x 3 linears x 3 tensors (weight, weight_scale, weight_scale_2)
    assert ck.tensors_read == 1 + E * 3 * 3


def test_failures_are_clear(tmp_path):
    write_model(tmp_path / "m", "bf16")
    with pytest.raises(ValueError, match=r"layer 2 out of range: the model has 2 layers"):
        aj.checkpoint.load_moe_layer(tmp_path / "m", 2)
    with pytest.raises(ValueError, match=r"is not an MoE layer \(it has a dense MLP"):
        aj.checkpoint.load_moe_layer(tmp_path / "m", 0)
    with pytest.raises(CheckpointError, match="no config.json"):
        Checkpoint(tmp_path)

    # A missing tensor names the tensor and the file.
    missing = tmp_path / "missing"
    shutil.copytree(tmp_path / "m", missing)
    f = SafetensorsFile(missing / "model.safetensors")
    tensors = {n: f.get(n) for n in f.names() if "experts.3.up_proj" not in n}
    save_file(tensors, missing / "model.safetensors")
    with pytest.raises(CheckpointError,
                       match=r"tensor 'model.layers.1.mlp.experts.3.up_proj.weight' not found "
                             r"in .*missing \(files: model.safetensors\)"):
        aj.checkpoint.load_moe_layer(missing, 1)

    # A truncated file names the file.
    trunc = tmp_path / "trunc"
    shutil.copytree(tmp_path / "m", trunc)
    raw = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match=r"trunc/model.safetensors: truncated"):
        aj.checkpoint.load_moe_layer(trunc, 1)
    (trunc / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match=r"trunc/model.safetensors: corrupt"):
        aj.checkpoint.load_moe_layer(trunc, 1)

    # A shape that disagrees with config.json names the tensor, expected and actual.
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "m", bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 16}))
    with pytest.raises(ValueError, match=r"checkpoint disagrees with config.json: "
                                         r"MoEParams.gate_up: expected shape \(4, 32, 64\), "
                                         r"got \(4, 64, 64\)"):
        aj.checkpoint.load_moe_layer(bad, 1)

    # Unknown model_type / quant_method list the supported ones.
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ValueError, match=r"unsupported model_type 'llama'; supported: "):
        aj.checkpoint.load_moe_layer(bad, 1)
    (bad / "config.json").write_text(json.dumps(
        {**cfg, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(ValueError, match=r"unsupported quant_method 'gptq'; supported: modelopt"):
        aj.checkpoint.load_moe_layer(bad, 1)


def test_mixed_formats_shared_expert_in_its_own_format(tmp_path):
    """Routed experts NVFP4, shared expert left BF16 (as exclude_modules would)."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "qwen3_next_norm", src)
    dst = tmp_path / "nvfp4"
    quantize_checkpoint(src, dst, "nvfp4", progress=False)
    p = aj.checkpoint.load_moe_layer(dst, 1)
    assert p.config.expert_format is Format.NVFP4
    assert p.config.shared_format is Format.BF16 and p.shared_gate_up.format is Format.BF16
    q = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert any("shared_expert" in m for m in q["exclude_modules"])
    assert not any("experts.0." in m for m in q["exclude_modules"])


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "mxfp4"])
def test_quantize_command_round_trip(tmp_path, fmt):
    src = tmp_path / "src"
    write_model(src, "bf16", shards=2)
    dst = tmp_path / fmt
    assert cli.main(["quantize", str(src), str(dst), "--format", fmt, "--quiet"]) == 0
    assert (dst / "model.safetensors.index.json").is_file()
    ours = aj.checkpoint.load_moe_layer(dst, 1)
    ref = aj.checkpoint.load_moe_layer(src, 1)
    # What was written loads back bit-exactly as our quantizer's output of the same weights
    # (gate and up are separate linears in the checkpoint, each with its own scales).
    f = ours.config.expert_format
    gate, up = jnp.split(dequantize(ref.gate_up), 2, axis=1)
    want = aj.quant.concat_rows(aj.quant.quantize(gate, f), aj.quant.quantize(up, f))
    np.testing.assert_array_equal(np.asarray(dequantize(ours.gate_up)),
                                  np.asarray(dequantize(want)))
    err = np.linalg.norm(dequantize(ours.down) - dequantize(ref.down)) / np.linalg.norm(
        dequantize(ref.down))
    assert err < {"nvfp4": 0.15, "mxfp4": 0.2, "fp8": 0.05}[fmt]
    # Everything else is copied unchanged.
    a, b = Checkpoint(src), Checkpoint(dst)
    np.testing.assert_array_equal(a.get("model.layers.0.mlp.gate_proj.weight"),
                                  b.get("model.layers.0.mlp.gate_proj.weight"))


def test_quantize_command_errors(tmp_path, capsys):
    src = tmp_path / "src"
    write_model(src, "modelopt")
    assert cli.main(["quantize", str(src), str(tmp_path / "o"), "--format", "fp8",
                        "--quiet"]) == 2
    assert "already quantized (modelopt)" in capsys.readouterr().err
    with pytest.raises(NotImplementedError, match="fused expert stacks"):
        quantize_checkpoint(FIXTURES / "gpt_oss", tmp_path / "g", "nvfp4",
                                                   progress=False)
    with pytest.raises(ValueError, match=r"K=16 is not a multiple of the mxfp4 block 32"):
        quantize_checkpoint(FIXTURES / "qwen3_moe_norm", tmp_path / "q",
                                                   "mxfp4", progress=False)
    with pytest.raises(SystemExit):
        cli.main(["quantize", str(src), str(tmp_path / "o2"), "--format", "int4"])
