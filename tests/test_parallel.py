"""Expert parallelism on 8 fake CPU devices (tests/conftest.py sets the device count): EP = 2, 4,
8 equal the single-device moe_forward for every router and weight format, skewed and empty
devices, jit, a data axis, placement, loading shards straight to devices, and the errors.

Compiling dominates the time (a few seconds a program on CPU): the router and format cases
spread the EP sizes over the cases instead of taking the full product (every router, every
format and every EP size is covered), and programs are compiled at XLA:CPU's LLVM
optimization level 0 (``compiled``), which halves compile time; the numbers compared are
computed the same way on both sides.
"""

import dataclasses
import functools
import re
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import atlas_jax as aj
from atlas_jax.checkpoint import Checkpoint
from atlas_jax.config import Format, MoEConfig
from atlas_jax.moe import parallel
from tests.test_moe import ROUTERS, E, H, I, rel_err, token_ids_for, tokens

FIXTURES = Path(__file__).parent / "fixtures"
EP_SIZES = (2, 4, 8)


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 "
                    "(tests/conftest.py sets it unless jax was initialised earlier)")


def mesh_of(d, names=("expert",)):
    return jax.make_mesh((d,), names, devices=jax.devices()[:d])


FAST = {"xla_backend_optimization_level": 0}  # CPU compile time only


def compiled(f, *args):
    """``jax.jit(f)(*args)``, compiled with FAST."""
    return jax.jit(f).lower(*args).compile(compiler_options=FAST)(*args)


@functools.cache
def make(name, fmt=Format.BF16, dtype=jnp.float32, seed=0, **extra):
    """test_moe.make's configs; params built by one jitted init_params, cached."""
    kw = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2)
    kw.update(ROUTERS[name])
    kw.update(extra)
    cfg = MoEConfig(expert_format=fmt, **kw)
    return compiled(lambda key: aj.moe.init_params(key, cfg, dtype=dtype), jax.random.key(seed))


def single_device(p, x, tids=None):
    """The one-device moe_forward."""
    return compiled(lambda p, x, t: aj.moe_forward(p, x, token_ids=t), p, x, tids)


def ep_matches_single_device(p, x, d, tids=None, tol=1e-5):
    """Shard over d devices, run, compare with the one-device forward; returns (y, ref)."""
    mesh = mesh_of(d)
    ref = single_device(p, x, tids)
    y = compiled(lambda p, x, t: aj.moe_forward(p, x, token_ids=t, mesh=mesh),
                 aj.moe.shard(p, mesh), x, tids)
    chex.assert_shape(y, x.shape)
    chex.assert_type(y, x.dtype)
    chex.assert_tree_all_finite(y)
    assert rel_err(y, ref) < tol, (d, rel_err(y, ref))
    return y, ref


# ---- every router, every format, EP = 2 / 4 / 8 ----------------------------------------------


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_every_router_equals_single_device(name):
    d = EP_SIZES[sorted(ROUTERS).index(name) % 3]
    p = make(name)
    x = tokens(13)  # padded to 14 / 16 / 16 tokens; at EP=8 device 7 holds only padding
    ep_matches_single_device(p, x, d, token_ids_for(p, 13))


@pytest.mark.parametrize("fmt,d", [(Format.BF16, 8), (Format.FP8_BLOCK, 2), (Format.NVFP4, 4),
                                   (Format.MXFP4, 8)])
def test_every_format_equals_single_device(fmt, d):
    p = make("qwen3", fmt=fmt, num_experts=16, seed=3)  # (routers: covered above)
    ep_matches_single_device(p, tokens(16, seed=4), d)


def test_w8a8_equals_single_device():
    """MoEConfig's W8A8 activation quantization reaches the expert-parallel grouped matmuls:
    the same result as one device, and not the weight-only one."""
    quant = dict(gate_up_act_quant="fp8", down_act_quant="fp8")
    p = make("deepseek_v3", fmt=Format.FP8_BLOCK, num_experts=16, seed=3, **quant)
    y, _ = ep_matches_single_device(p, tokens(16, seed=4), 4)
    w8a16 = single_device(make("deepseek_v3", fmt=Format.FP8_BLOCK, num_experts=16, seed=3),
                          tokens(16, seed=4))
    assert rel_err(y, w8a16) > 5e-3, rel_err(y, w8a16)


def test_pallas_router_inside_shard_map():
    """KernelConfig.router="pallas" (interpret mode on CPU) inside the expert-parallel body:
    the same result as the one-device forward with XLA's router."""
    p = make("deepseek_v3")
    x = tokens(12, seed=5)
    mesh = mesh_of(4)
    kernels = aj.KernelConfig(router="pallas")

    def fwd(p, x):
        return aj.moe_forward(p, x, mesh=mesh, kernels=kernels)

    sharded = aj.moe.shard(p, mesh)
    assert "name=moe_router" in str(jax.make_jaxpr(fwd)(sharded, x))  # the kernel is traced
    y = compiled(fwd, sharded, x)
    ref = single_device(p, x)
    assert rel_err(y, ref) < 1e-5, rel_err(y, ref)


# ---- skewed routing: one device gets most rows, others none -----------------------------------


def rows_per_device(p, x, d, tids=None):
    r = aj.moe.route(p, x, token_ids=tids)
    ids = np.asarray(r.expert_ids).reshape(-1)
    e = p.config.num_experts
    return np.bincount(ids[ids < e] // (e // d), minlength=d)


def test_skewed_routing_one_device_most_rows_one_device_none():
    p = make("qwen3")
    x = tokens(16)
    favour = x.sum(0) / jnp.linalg.norm(x.sum(0))
    router = p.router.at[0].set(favour * 6).at[1].set(favour * 0.5)  # device 0's experts
    router = router.at[6].set(-favour * 20).at[7].set(-favour * 20)  # device 3's experts: none
    p = dataclasses.replace(p, router=router)
    counts = rows_per_device(p, x, 4)
    assert counts[0] > 0.6 * counts.sum() and counts[3] == 0, counts
    assert (counts > 0).sum() >= 3, counts  # not trivially all on one device
    ep_matches_single_device(p, x, 4)


def test_zero_experts_mostly_never_sent():
    p = make("longcat")  # 8 routed + 3 zero experts
    x = tokens(16)
    favour = x.sum(0) / jnp.linalg.norm(x.sum(0))
    router = p.router.at[8:].set(favour * 8)  # zero experts win most slots
    p = dataclasses.replace(p, router=router)
    r = aj.moe.route(p, x)
    assert (np.asarray(r.expert_ids) >= 8).mean() > 0.5
    ep_matches_single_device(p, x, 2)


# ---- jit, batched shapes, data axis, custom axis names ----------------------------------------


def test_jit_batched_bf16():
    p = make("qwen2_shared", dtype=jnp.bfloat16)
    mesh = mesh_of(4)
    ps = aj.moe.shard(p, mesh)
    x = tokens(24, dtype=jnp.bfloat16).reshape(3, 8, H)
    traces = []

    @functools.partial(jax.jit, compiler_options=FAST)
    def f(p, x):
        traces.append(1)
        return aj.moe_forward(p, x, mesh=mesh)

    ref = jax.jit(aj.moe_forward).lower(p, x).compile(FAST)
    for scale in (1, 2):
        y = f(ps, x * scale)
        chex.assert_shape(y, (3, 8, H))
        chex.assert_type(y, jnp.bfloat16)
        # expert outputs travel back in bf16 (the bf16 path's operand dtype): bf16 round-off
        assert rel_err(y, ref(p, x * scale)) < 1e-2
    assert len(traces) == 1


def test_data_axis_and_custom_axis_names():
    p = make("gpt_oss")  # expert biases: sharded too
    mesh = jax.make_mesh((2, 4), ("dp", "ep"))
    ps = aj.moe.shard(p, mesh, expert_axis="ep", data_axis="dp")
    for leaf in jax.tree_util.tree_leaves(ps.gate_up) + [ps.gate_up_bias, ps.down_bias]:
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, P("ep")), leaf.ndim)
    assert parallel._default_expert_axis(ps, mesh) == "ep"  # eager calls read it from params
    x = tokens(20)  # 8 token shards: padded to 24
    y = compiled(lambda p, x: aj.moe_forward(p, x, mesh=mesh, expert_axis="ep", data_axis="dp"),
                 ps, x)
    assert rel_err(y, single_device(p, x)) < 1e-5


def test_shard_placement():
    p = make("gemma4")  # per_expert_scale: sharded; router_scale, pre_expert_norm: replicated
    mesh = mesh_of(8)
    ps = aj.moe.shard(p, mesh)
    expert = NamedSharding(mesh, P("expert"))
    for name in parallel.EXPERT_FIELDS:
        for leaf in jax.tree_util.tree_leaves(getattr(ps, name)):
            assert leaf.sharding.is_equivalent_to(expert, leaf.ndim), name
            assert {s.data.shape[0] for s in leaf.addressable_shards} == {1}, name
    for name in ("router", "router_scale", "pre_expert_norm"):
        leaf = getattr(ps, name)
        assert leaf.sharding.is_fully_replicated, name
    assert ps.config == p.config
    np.testing.assert_array_equal(ps.gate_up.data, p.gate_up.data)


def test_ragged_transport_lowers_to_ragged_all_to_all():
    """XLA:CPU cannot run ragged-all-to-all; check the GPU transport traces and lowers."""
    p = make("longcat")
    mesh = mesh_of(4)
    ps = aj.moe.shard(p, mesh)
    text = parallel._forward.lower(
        ps, tokens(8), None, mesh=mesh, expert_axis="expert", data_axis=None,
        kernels=aj.KernelConfig(), transport=parallel.Transport.RAGGED, out_shape=(8, H)
    ).as_text()
    assert text.count("ragged_all_to_all") == 2  # rows out, results back
    # "auto" takes the dense transport (measured 12x faster than ragged on 2 x H200)
    assert parallel._resolve_transport("auto", mesh) is parallel.Transport.DENSE


# ---- errors -----------------------------------------------------------------------------------


def test_errors():
    p = make("qwen3")
    mesh = mesh_of(8)
    x = tokens(4)
    with pytest.raises(ValueError, match=r"num_experts=12 must be divisible by the size of mesh "
                                         r"axis 'expert', got 8"):
        aj.moe.shard(make("qwen3", num_experts=12), mesh)
    with pytest.raises(ValueError, match=r"expert_axis='experts' is not an axis of the mesh; "
                                         r"its axes are \('expert',\)"):
        aj.moe.shard(p, mesh, expert_axis="experts")
    with pytest.raises(ValueError, match=r"data_axis='data' is not an axis"):
        aj.moe.shard(p, mesh, data_axis="data")
    with pytest.raises(ValueError, match="data_axis and expert_axis must differ"):
        aj.moe.shard(p, mesh, data_axis="expert")
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        aj.moe.shard(p, "expert")
    with pytest.raises(ValueError, match=r"params.gate_up is not split over mesh axis 'expert'.*"
                                         r"aj.moe.shard"):
        aj.moe_forward(p, x, mesh=mesh)  # forgot to shard
    ps = aj.moe.shard(p, mesh)
    with pytest.raises(ValueError, match=r"expert_axis='nope' is not an axis of the mesh"):
        aj.moe_forward(ps, x, mesh=mesh, expert_axis="nope")
    with pytest.raises(NotImplementedError, match="XLA:CPU does not implement ragged"):
        parallel.moe_forward_parallel(ps, x, mesh, transport="ragged")
    with pytest.raises(ValueError, match=r"transport='fast', expected one of"):
        parallel.moe_forward_parallel(ps, x, mesh, transport="fast")
    with pytest.raises(NotImplementedError, match="no decode variant"):
        aj.moe_forward(ps, x, mesh=mesh, kernels=aj.KernelConfig(moe_path="decode"))
    with pytest.raises(ValueError, match="expert_axis / data_axis need mesh="):
        aj.moe_forward(p, x, expert_axis="expert")
    with pytest.raises(ValueError, match="last dim must be hidden_size=64"):
        aj.moe_forward(ps, jnp.ones((3, 32)), mesh=mesh)
    hashed = aj.moe.shard(make("deepseek_v4_hash"), mesh)
    with pytest.raises(ValueError, match="hash-routing layer .* pass token_ids"):
        aj.moe_forward(hashed, x, mesh=mesh)
    with pytest.raises(ValueError, match=r"token_ids: 1 value\(s\) outside \[0, 50\)"):
        aj.moe_forward(hashed, x, mesh=mesh, token_ids=jnp.array([1, 2, 50, 3]))
    chex.assert_shape(aj.moe_forward(ps, jnp.zeros((0, H)), mesh=mesh), (0, H))
    two_axes = jax.make_mesh((2, 4), ("a", "b"))
    with pytest.raises(ValueError, match=r"pass expert_axis=: the mesh has axes \('a', 'b'\)"):
        aj.moe_forward(p, x, mesh=two_axes)


# ---- loading shards straight to their devices --------------------------------------------------

_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.")


def test_each_shard_reads_only_its_experts():
    ck = Checkpoint(FIXTURES / "moe" / "qwen3_moe_nonorm")  # E=16, per-expert tensors
    layer, d = 0, 4
    read: list[str] = []
    get = ck.get
    ck.get = lambda name: read.append(name) or get(name)
    cache: dict = {}
    for s in range(d):
        read.clear()
        before = ck.tensors_read
        fields = parallel.load_expert_shard(ck, layer, s, d, cache=cache)
        assert ck.tensors_read - before == len(read)
        experts = sorted({int(m[1]) for n in read if (m := _EXPERT_NAME.search(n))})
        assert experts == list(range(4 * s, 4 * s + 4)), (s, experts)
        per_expert = [n for n in read if _EXPERT_NAME.search(n)]
        assert len(per_expert) == len(set(per_expert)) == 3 * 4  # gate, up, down once each
        others = [n for n in read if not _EXPERT_NAME.search(n)]
        assert others == (["model.layers.0.mlp.gate.weight"] if s == 0 else []), others
        assert fields["gate_up"].shape[0] == fields["down"].shape[0] == 4


@pytest.mark.parametrize("fixture,d", [("moe_quantized/deepseek_v3_fp8", 4),
                                       ("moe_quantized/gpt_oss_mxfp4", 8)])
def test_load_sharded_equals_load_then_shard(fixture, d):
    path = FIXTURES / fixture
    g = np.load(path / "golden.npz")
    layer = int(g["layer"])
    mesh = mesh_of(d)
    ck = Checkpoint(path)
    ps = aj.moe.load_moe_layer_sharded(ck, layer, mesh)
    ref = aj.checkpoint.load_moe_layer(path, layer)
    assert ps.config == ref.config
    chex.assert_trees_all_equal_structs(ps, ref)
    expert = NamedSharding(mesh, P("expert"))
    for name in parallel.EXPERT_FIELDS:
        for a, b in zip(jax.tree_util.tree_leaves(getattr(ps, name)),
                        jax.tree_util.tree_leaves(getattr(ref, name)), strict=True):
            assert a.sharding.is_equivalent_to(expert, a.ndim), name
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for name in ("router", "shared_gate_up", "router_bias", "selection_bias"):
        for a, b in zip(jax.tree_util.tree_leaves(getattr(ps, name)),
                        jax.tree_util.tree_leaves(getattr(ref, name)), strict=True):
            assert a.sharding.is_fully_replicated, name
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if "deepseek" in fixture:  # (gpt-oss's forward at EP=8 is covered above)
        x = jnp.asarray(g["x"])
        y = aj.moe_forward(ps, x, mesh=mesh)
        assert rel_err(y, single_device(ref, x)) < 1e-5
        assert rel_err(y, g["y"]) < 1e-4  # transformers' golden, as test_quantized_goldens


def test_load_sharded_errors():
    path = FIXTURES / "moe" / "qwen3_moe_nonorm"
    with pytest.raises(ValueError, match=r"num_experts=16 must be divisible .* got 3"):
        aj.moe.load_moe_layer_sharded(path, 0, mesh_of(3))
    with pytest.raises(ValueError, match=r"expert_axis='x' is not an axis"):
        aj.moe.load_moe_layer_sharded(path, 0, mesh_of(2), expert_axis="x")
    with pytest.raises(ValueError, match=r"shard_index=4 must be in \[0, 4\)"):
        parallel.load_expert_shard(path, 0, 4, 4)
