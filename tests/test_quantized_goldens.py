"""moe_forward on checkpoints written by ``atlas-jax quantize``, against transformers dequantizing
the same files (``Mxfp4Config`` / ``FineGrainedFP8Config`` with ``dequantize=True``).

Fixtures: tests/fixtures/moe_quantized/<name>/ (config.json, model.safetensors, golden.npz), made
by checkpoints/goldens/make_quantized_goldens.py (see tests/fixtures/moe_quantized/README.md).
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import atlas_jax as aj
from atlas_jax.config import Format
from tests.test_moe_goldens import assert_routing_equal

FIXTURES = Path(__file__).parent / "fixtures" / "moe_quantized"
NAMES = sorted(d.name for d in FIXTURES.iterdir() if (d / "golden.npz").is_file())
FORMATS = {"mxfp4": Format.MXFP4, "fp8": Format.FP8_BLOCK}


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_fixtures_present():
    assert {"gpt_oss_mxfp4", "deepseek_v3_fp8", "qwen3_moe_fp8"} <= set(NAMES)


@pytest.fixture(scope="module")
def loaded():
    cache = {}

    def load(name):
        if name not in cache:
            g = dict(np.load(FIXTURES / name / "golden.npz"))
            cache[name] = aj.checkpoint.load_moe_layer(FIXTURES / name, int(g["layer"])), g
        return cache[name]

    return load


@pytest.mark.parametrize("name", NAMES)
def test_loads_in_quantized_format(loaded, name):
    params, _ = loaded(name)
    q = json.loads((FIXTURES / name / "config.json").read_text())["quantization_config"]
    fmt = FORMATS[q["quant_method"]]
    assert params.config.expert_format is fmt
    assert params.gate_up.format is fmt and params.down.format is fmt
    if params.shared_gate_up is not None:  # quantized only where the writer was told --shared
        shared_quantized = not any("shared_expert" in m for m in q["modules_to_not_convert"])
        want = fmt if shared_quantized else Format.BF16
        assert params.config.shared_expert_format is want
        assert params.shared_gate_up.format is want


@pytest.mark.parametrize("name", NAMES)
def test_routing_matches_transformers(loaded, name):
    params, g = loaded(name)
    assert_routing_equal(aj.moe.route(params, jnp.asarray(g["x"])), g)


@pytest.mark.parametrize("path", ["prefill", "decode"])
@pytest.mark.parametrize("name", NAMES)
def test_moe_forward_matches_transformers(loaded, name, path):
    params, g = loaded(name)
    fwd = jax.jit(aj.moe_forward, static_argnames="kernels")
    y = fwd(params, jnp.asarray(g["x"]), kernels=aj.KernelConfig(moe_path=path))
    assert rel_err(y, g["y"]) < 1e-4
    # The tolerance is far below the quantization error: float weights would fail.
    assert rel_err(g["y_float"], g["y"]) > 1e-2
