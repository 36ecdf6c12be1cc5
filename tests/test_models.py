"""End to end: ``aj.models.load`` on the shipped checkpoints against transformers' goldens, greedy
generation over the paged KV cache, batching, compilation counts, errors, and the CLI.

Goldens: ``checkpoints/qwen3-moe-tiny/goldens.npz`` (``checkpoints/make_checkpoint.py``,
transformers 5.24 in float32 on the BF16 weights upcast exactly).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import atlas_jax as aj
from atlas_jax import cli
from atlas_jax._safetensors import CheckpointError, SafetensorsFile, save_file
from atlas_jax.config import Format, KVDtype
from atlas_jax.models import qwen3_moe
from atlas_jax.models.qwen3_moe import TRACES, Qwen3MoEConfig
from atlas_jax.quantize_checkpoint import quantize_checkpoint

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "checkpoints" / "qwen3-moe-tiny"
TINY_NVFP4 = REPO / "checkpoints" / "qwen3-moe-tiny-nvfp4"
N_NEW = 16

# What the NVFP4 checkpoint (routed experts in ModelOpt NVFP4, written by `atlas-jax quantize`)
# generates, float32 activations and KV, for the three golden prompts; and how many of its 16
# tokens equal the BF16 checkpoint's (transformers' golden) tokens: they agree up to the first
# divergence (3, 11 and 11 tokens), then continue on their own path.
NVFP4_TOKENS = [
    [486, 234, 236, 0, 447, 372, 212, 50, 127, 392, 365, 429, 313, 240, 193, 134],
    [501, 354, 20, 163, 12, 311, 462, 231, 331, 163, 353, 110, 391, 499, 351, 3],
    [411, 109, 365, 262, 295, 274, 314, 295, 274, 314, 295, 274, 365, 262, 35, 58],
]
NVFP4_AGREEING_PREFIX = [3, 11, 11]


def rel_err(x, ref) -> float:
    """max |x - ref| / max |ref|."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(x - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def goldens() -> dict[str, np.ndarray]:
    return dict(np.load(TINY / "goldens.npz"))


def prompt(goldens, i: int) -> np.ndarray:
    return goldens[f"prompt_{i}"]


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> Path:
    """The tiny checkpoint with FP8-block experts, written by `atlas-jax quantize`."""
    dst = tmp_path_factory.mktemp("ckpt") / "qwen3-moe-tiny-fp8"
    return quantize_checkpoint(TINY, dst, "fp8", progress=False)


@pytest.fixture(scope="module")
def model():
    """The BF16 checkpoint in float32 with a float32 KV cache: transformers' numerics."""
    return aj.models.load(TINY, kv_dtype=KVDtype.FLOAT32, dtype=jnp.float32, progress=False)


# ---- against transformers -----------------------------------------------------------------------


def test_model_structure(model):
    cfg = model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (4, 256, 512)
    assert cfg.moe_layers == (False, True, True, True)  # mlp_only_layers=[0]
    assert not cfg.tie_word_embeddings and model.params.lm_head is not None
    assert isinstance(model.params.layers[0].mlp, qwen3_moe.DenseMLPParams)
    assert isinstance(model.params.layers[1].mlp, aj.moe.MoEParams)
    assert model.params.layers[1].mlp.config.top_k == 4
    assert model.params.embed.dtype == jnp.float32
    assert "4 layers (3 MoE, 1 dense)" in repr(model)


@pytest.mark.parametrize("i", [0, 1, 2])
def test_forward_matches_transformers(model, goldens, i):
    logits = model.forward(prompt(goldens, i)[None])
    ref = goldens[f"logits_{i}"]
    assert logits.shape == (1, *ref.shape) and logits.dtype == jnp.float32
    assert rel_err(logits[0], ref) < 1e-3
    np.testing.assert_array_equal(np.argmax(logits[0], -1), np.argmax(ref, -1))


def test_generate_matches_transformers(model, goldens):
    for i in range(3):
        tokens = model.generate(prompt(goldens, i)[None], max_new_tokens=N_NEW)
        assert tokens.shape == (1, N_NEW) and tokens.dtype == jnp.int32
        np.testing.assert_array_equal(tokens[0], goldens[f"tokens_{i}"], err_msg=f"prompt {i}")


def test_generate_through_pallas_kernels(goldens):
    """kernels="pallas" (the Pallas kernels where they apply, in interpret mode on CPU; the
    paged prefill and decode attention kernels included) gives transformers' greedy tokens."""
    m = aj.models.load(TINY, kv_dtype=KVDtype.FLOAT32, dtype=jnp.float32, kernels="pallas",
                       progress=False)
    tokens = m.generate(prompt(goldens, 0)[None], max_new_tokens=3)
    np.testing.assert_array_equal(tokens[0], goldens["tokens_0"][:3])


def test_generate_is_argmax_of_repeated_forward(model, goldens):
    seq = list(prompt(goldens, 1))
    n = 8
    for _ in range(n):
        seq.append(int(np.argmax(model.forward(np.asarray(seq)[None])[0, -1])))
    tokens = model.generate(prompt(goldens, 1)[None], max_new_tokens=n)
    assert tokens[0].tolist() == seq[-n:]


def test_batch_of_different_lengths_equals_each_alone(model, goldens):
    """Right padding: a ragged list, or a [B, S] array with lengths; same tokens as alone."""
    short, long = prompt(goldens, 0), prompt(goldens, 2)  # 5 and 23 tokens
    want = np.stack([goldens["tokens_0"], goldens["tokens_2"]])  # = each prompt alone (above)
    tokens = model.generate([short, long], max_new_tokens=N_NEW)
    np.testing.assert_array_equal(tokens, want)
    padded = np.full((2, len(long)), 7, np.int32)  # padding ids are ignored
    padded[0, :len(short)] = short
    padded[1] = long
    tokens = model.generate(padded, max_new_tokens=N_NEW, lengths=[len(short), len(long)])
    np.testing.assert_array_equal(tokens, want)


def test_decode_step_compiled_once(model, goldens):
    before = dict(TRACES)
    model.generate(prompt(goldens, 1)[None], max_new_tokens=N_NEW)
    # At most one trace of each step for a whole generation (none if this bucket ran before).
    assert TRACES["decode"] - before.get("decode", 0) <= 1
    assert TRACES["prefill"] - before.get("prefill", 0) <= 1
    assert TRACES["decode"] >= 1
    warm = dict(TRACES)
    # Same batch bucket (B=1), other prompts and lengths: nothing is traced again.
    model.generate(prompt(goldens, 0)[None], max_new_tokens=5)
    model.generate(prompt(goldens, 2)[None, :9], max_new_tokens=N_NEW)
    model.generate([[5, 6, 7]], max_new_tokens=2)
    assert dict(TRACES) == warm
    # A fixed capacity (4 pages here): the decode step compiles once per batch bucket, for any
    # lengths up to max_seq_len.
    fixed = dataclasses.replace(model, max_seq_len=64)
    fixed.generate(prompt(goldens, 2)[None], max_new_tokens=64 - 23)
    assert dict(TRACES) == warm
    with pytest.raises(ValueError, match="is 65 tokens, over max_seq_len=64"):
        fixed.generate(prompt(goldens, 2)[None], max_new_tokens=42)


def test_nvfp4_checkpoint(goldens):
    m = aj.models.load(TINY_NVFP4, kv_dtype="float32", dtype=jnp.float32, progress=False)
    moe = m.params.layers[1].mlp
    assert moe.gate_up.format is Format.NVFP4 and moe.down.format is Format.NVFP4
    assert m.params.layers[0].mlp.gate_up.format is Format.BF16  # dense MLP kept as stored
    tokens = m.generate([prompt(goldens, i) for i in range(3)], max_new_tokens=N_NEW)
    assert tokens.tolist() == NVFP4_TOKENS
    for i, prefix in enumerate(NVFP4_AGREEING_PREFIX):
        same = np.asarray(tokens[i]) == goldens[f"tokens_{i}"]
        assert same[:prefix].all() and not same[prefix], (i, same)


def test_tied_embeddings(model, tmp_path):
    """tie_word_embeddings: no lm_head.weight is read; the head is the embedding."""
    tied = tmp_path / "tied"
    tied.mkdir()
    f = SafetensorsFile(TINY / "model.safetensors")
    save_file({n: f.get(n) for n in f.names() if n != "lm_head.weight"},
              tied / "model.safetensors")
    config = json.loads((TINY / "config.json").read_text()) | {"tie_word_embeddings": True}
    (tied / "config.json").write_text(json.dumps(config))
    params = aj.models.load(tied, kv_dtype="float32", dtype=jnp.float32, progress=False).params
    assert params.lm_head is None and params.config.tie_word_embeddings
    h = jax.random.normal(jax.random.key(0), (3, 256))
    np.testing.assert_allclose(qwen3_moe.logits(params, h), h @ params.embed.T, rtol=1e-5,
                               atol=1e-5)
    # The untied model's head is lm_head.weight, not the embedding.
    assert not np.allclose(qwen3_moe.logits(model.params, h), h @ model.params.embed.T)


def test_sharded_checkpoint(model, tmp_path):
    """model.safetensors.index.json + two shards: the same params."""
    f = SafetensorsFile(TINY / "model.safetensors")
    names = sorted(f.names())
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: f.get(n) for n in part}, tmp_path / file)
    index = {"weight_map": {n: file for file, part in shards.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    params = aj.models.load(tmp_path, dtype=jnp.float32, progress=False).params
    assert jax.tree.structure(params) == jax.tree.structure(model.params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(model.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_fp8_and_mxfp4_experts(goldens, tmp_path, fp8_checkpoint):
    """FP8-block and MXFP4 experts (written by `atlas-jax quantize`) load as stored; MXFP4 runs
    here, FP8 in the CLI test below (generate with an NVFP4 KV cache)."""
    mxfp4 = quantize_checkpoint(TINY, tmp_path / "mxfp4", "mxfp4", progress=False)
    for path, want in ((fp8_checkpoint, Format.FP8_BLOCK), (mxfp4, Format.MXFP4)):
        m = aj.models.load(path, kv_dtype="float32", dtype=jnp.float32, progress=False)
        moe = m.params.layers[1].mlp
        assert moe.gate_up.format is want and moe.down.format is want
    err = rel_err(m.forward(prompt(goldens, 0)[None])[0], goldens["logits_0"])
    assert err < 0.15, err  # observed 0.074 (FP8 experts: 0.067)


@pytest.mark.parametrize("config, moe", [
    (dict(mlp_only_layers=[0], decoder_sparse_step=1), (False, True, True, True)),
    (dict(mlp_only_layers=[], decoder_sparse_step=2), (False, True, False, True)),
    (dict(mlp_only_layers=[1, 2], decoder_sparse_step=1), (True, False, False, True)),
    (dict(mlp_only_layers=[3], decoder_sparse_step=2), (False, True, False, False)),
    (dict(mlp_only_layers=None, decoder_sparse_step=1, num_experts=0), (False,) * 4),
])
def test_moe_layer_rule(config, moe):
    """transformers' Qwen3MoeDecoderLayer: MoE iff i not in mlp_only_layers and
    num_experts > 0 and (i + 1) % decoder_sparse_step == 0."""
    d = json.loads((TINY / "config.json").read_text()) | config
    if "num_experts" in config:
        d.pop("num_local_experts")
    assert Qwen3MoEConfig.from_hf_config(d).moe_layers == moe


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("ids, exc, match", [
    (np.array([1, 2, 3]), ValueError, r"input_ids must be \[B, S\].*shape \(3,\)"),
    (np.ones((1, 2, 3), np.int32), ValueError, r"input_ids must be \[B, S\]"),
    (np.ones((1, 3), np.float32), TypeError, "integer token ids, got dtype float32"),
    (np.zeros((1, 0), np.int32), ValueError, "at least one token"),
    (np.array([[1, 512]]), ValueError, r"outside \[0, vocab_size=512\); first bad id 512"),
    (np.array([[-1, 2]]), ValueError, "first bad id -1"),
])
def test_bad_input_ids(model, ids, exc, match):
    with pytest.raises(exc, match=match):
        model.generate(ids, max_new_tokens=2)
    with pytest.raises(exc, match=match):
        model.forward(ids)


def test_bad_generate_arguments(model):
    ids = np.array([[1, 2, 3]])
    for n in (0, -1):
        with pytest.raises(ValueError, match=f"max_new_tokens must be >= 1, got {n}"):
            model.generate(ids, max_new_tokens=n)
    with pytest.raises(TypeError, match="max_new_tokens must be an int"):
        model.generate(ids, max_new_tokens=2.0)
    with pytest.raises(ValueError, match=r"lengths must be in \[1, S=3\]"):
        model.generate(ids, max_new_tokens=2, lengths=[4])
    with pytest.raises(ValueError, match=r"lengths must be \[B=1\]"):
        model.generate(ids, max_new_tokens=2, lengths=[1, 2])
    with pytest.raises(ValueError, match="ragged list"):
        model.generate([[1, 2], [3]], max_new_tokens=2, lengths=[2, 1])


def test_load_errors(tmp_path):
    other = REPO / "tests" / "fixtures" / "moe" / "mixtral"
    with pytest.raises(NotImplementedError, match="'mixtral' is not supported.*qwen3_moe"):
        aj.models.load(other)
    with pytest.raises(CheckpointError, match="no config.json"):
        aj.models.load(tmp_path)
    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        aj.models.load(tmp_path)
    with pytest.raises(ValueError, match="kv_dtype"):
        aj.models.load(TINY, kv_dtype="int4")


def test_load_progress_bar(capsys):
    aj.models.load(TINY, progress=True)
    err = capsys.readouterr().err
    assert "load qwen3-moe-tiny" in err and "185/185 tensors" in err


# ---- the command --------------------------------------------------------------------------------


def test_cli_generate_default_checkpoint(capsys, monkeypatch, tmp_path, goldens):
    monkeypatch.chdir(tmp_path)  # the shipped checkpoint is found from anywhere
    assert cli.main(["generate", "--max-new-tokens", "3", "--quiet", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-moe-tiny" in out
    assert f"prompt (5 tokens): {','.join(map(str, prompt(goldens, 0)))}" in out
    # BF16 activations and KV agree with transformers' float32 tokens here.
    assert f"new tokens (3): {','.join(map(str, goldens['tokens_0'][:3]))}" in out
    assert "prefill: " in out and "decode: " in out and "/ token over 2 steps" in out


def test_cli_generate_batch_fp8_experts_nvfp4_kv(capsys, fp8_checkpoint):
    """A batch of two prompts, FP8-block experts, an NVFP4 KV cache; then errors."""
    argv = ["generate", "--checkpoint", str(fp8_checkpoint), "--prompt-ids", "5,6,7",
            "--prompt-ids", "9", "--max-new-tokens", "2", "--dtype", "float32", "--kv-dtype",
            "nvfp4", "--quiet", "--repeat", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "kv nvfp4" in out
    assert "[0] prompt (3 tokens): 5,6,7" in out and "[1] new tokens (2): " in out
    assert cli.main(["generate", "--checkpoint", str(TINY), "--prompt-ids", "1,999",
                     "--quiet"]) == 2
    assert "first bad id 999" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt-ids", "1,x"])
    with pytest.raises(SystemExit):
        cli.main(["generate", "--max-new-tokens", "0"])


def test_w8a8_load_and_cli(capsys, fp8_checkpoint):
    """``act_quant="fp8"`` (``--act-quant fp8``) runs the FP8 experts W8A8: every MoE layer's
    config says so, the logits move by the activations' e4m3 rounding (not more), and a
    checkpoint without FP8 experts is refused."""
    ids = np.asarray([[5, 6, 7, 8]], np.int32)
    plain = aj.models.load(fp8_checkpoint, dtype=jnp.float32, progress=False)
    w8a8 = aj.models.load(fp8_checkpoint, dtype=jnp.float32, progress=False, act_quant="fp8")
    moe = [layer.mlp.config for layer in w8a8.params.layers
           if isinstance(layer.mlp, aj.moe.MoEParams)]
    assert moe and all(c.gate_up_act_quant is c.down_act_quant is aj.config.ActQuant.FP8
                       for c in moe)
    later = aj.models.qwen3_moe.with_act_quant(plain.params, "fp8")  # on loaded params
    assert [layer.mlp.config for layer in later.layers
            if isinstance(layer.mlp, aj.moe.MoEParams)] == moe
    a, b = np.asarray(plain.forward(ids)), np.asarray(w8a8.forward(ids))
    diff = np.linalg.norm(a - b) / np.linalg.norm(a)
    assert 1e-4 < diff < 0.1, diff
    argv = ["generate", "--checkpoint", str(fp8_checkpoint), "--prompt-ids", "5,6,7",
            "--max-new-tokens", "2", "--act-quant", "fp8", "--quiet", "--repeat", "1"]
    assert cli.main(argv) == 0
    assert "act quant fp8" in capsys.readouterr().out
    assert cli.main(["generate", "--checkpoint", str(TINY), "--act-quant", "fp8", "--quiet",
                     "--max-new-tokens", "1", "--repeat", "1"]) == 2
    assert "gate_up_act_quant='fp8'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="act_quant: expected one of"):
        aj.models.load(fp8_checkpoint, act_quant="int8", progress=False)


@pytest.mark.parametrize("argv", [[], ["generate"], ["bench"], ["quantize"]])
def test_cli_help(capsys, argv):
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--help"])
    assert e.value.code == 0
    assert "usage: atlas-jax" in capsys.readouterr().out


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the no-GPU message")
def test_cli_bench_without_gpu(capfd):
    assert cli.main(["bench", "paged-attention", "--quick"]) == 1
    assert "needs a GPU" in capfd.readouterr().err
