"""moe_forward on HF directories saved by transformers, against transformers' own MoE blocks.

Fixtures: tests/fixtures/moe/<name>/ (config.json, model.safetensors, golden*.npz), made by
checkpoints/goldens/make_moe_goldens.py (see tests/fixtures/moe/README.md for the version).
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import atlas_jax as aj
from atlas_jax.checkpoint import Checkpoint

FIXTURES = Path(__file__).parent / "fixtures" / "moe"
GOLDENS = sorted((d.name, g.name) for d in FIXTURES.iterdir() if d.is_dir()
                 for g in d.glob("golden*.npz"))


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_all_ten_architectures_have_goldens():
    types = {Checkpoint(FIXTURES / name).config["model_type"] for name, _ in GOLDENS}
    assert types == set(aj.config.SUPPORTED_MODEL_TYPES)


@pytest.fixture(scope="module")
def loaded():
    cache = {}

    def load(name, golden):
        g = dict(np.load(FIXTURES / name / golden))
        key = (name, int(g["layer"]))
        if key not in cache:
            cache[key] = aj.checkpoint.load_moe_layer(FIXTURES / name, int(g["layer"]))
        return cache[key], g

    return load


@pytest.mark.parametrize("router", ["xla", "pallas"])
@pytest.mark.parametrize("name, golden", GOLDENS)
def test_routing_matches_transformers(loaded, name, golden, router):
    """Both router implementations (the Pallas one in interpret mode off GPU); hash-routing
    layers have no selection for the kernel, and say so."""
    params, g = loaded(name, golden)
    kernels = aj.KernelConfig(router=router)
    if router == "pallas" and params.config.hash_routing:
        with pytest.raises(NotImplementedError, match="hash routing"):
            aj.moe.route(params, jnp.asarray(g["x"]), token_ids=g["token_ids"], kernels=kernels)
        return
    r = aj.moe.route(params, jnp.asarray(g["x"]), token_ids=g.get("token_ids"), kernels=kernels)
    assert_routing_equal(r, g)


def assert_routing_equal(r, golden) -> None:
    """Our Routing equals transformers' expert_ids / weights; some HF routers use
    topk(sorted=False), so compare per token, sorted by expert id."""
    order_ours = np.argsort(np.asarray(r.expert_ids), axis=1)
    order_hf = np.argsort(golden["expert_ids"], axis=1)
    ids = np.take_along_axis(np.asarray(r.expert_ids), order_ours, 1)
    np.testing.assert_array_equal(ids, np.take_along_axis(golden["expert_ids"], order_hf, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(r.weights), order_ours, 1),
                               np.take_along_axis(golden["weights"], order_hf, 1), rtol=1e-5,
                               atol=1e-7)


@pytest.mark.parametrize("path", ["prefill", "decode"])
@pytest.mark.parametrize("name, golden", GOLDENS)
def test_moe_forward_matches_transformers(loaded, name, golden, path):
    params, g = loaded(name, golden)
    x = jnp.asarray(g["x"])
    fwd = jax.jit(aj.moe_forward, static_argnames="kernels")
    y = fwd(params, x, token_ids=g.get("token_ids"), kernels=aj.KernelConfig(moe_path=path))
    # Gemma-4's MoE output is y_routed; the layer then applies its post-FFN norms.
    want = g["y_routed"] if "y_dense" in g else g["y"]
    assert rel_err(y, want) < 1e-4
