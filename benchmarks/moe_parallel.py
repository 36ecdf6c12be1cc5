"""Expert-parallel MoE benchmark: a DeepSeek-V3-shaped layer (H 7168, I 2048, 256 experts, top-8,
sigmoid + groups, one shared expert, FP8 block weights, bf16 activations) at 4096 tokens,
expert parallel over D GPUs (default 2) against the same layer on one GPU.

    NCCL_NVLS_ENABLE=0 python benchmarks/moe_parallel.py [--devices 2] [--tokens 4096]
        [--format fp8_block] [--transports ragged,dense] [--out table.md]
    python benchmarks/moe_parallel.py --tiny   # CPU smoke test: fake devices, tiny shapes

Step 1 checks the EP output against the one-device output (relative error, bf16 activations).
Step 2 times (median of repeats, ``benchmarks/_common.time_jax``):

- ``1 dev``: ``aj.moe_forward(params, x)`` with every weight on device 0;
- ``EP=D``: ``aj.moe_forward(sharded, x, mesh=mesh)`` for each transport (``ragged`` =
  ``jax.lax.ragged_all_to_all``, ``dense`` = fixed-capacity ``all_to_all``), x already split
  over the devices;
- ``exchange``: the dispatch and combine traffic alone, with the same code
  (``parallel.dispatch_rows`` + ``parallel.return_rows``: the row sort, the count exchange, both
  all-to-alls and the expert-major reorder) on the routing of the real layer, and no expert math;
  ``a2a share`` = exchange / EP time.

Scaling efficiency = t(1 dev) / (D * t(EP=D)) (strong scaling: the same 4096 tokens).

``--diagnose`` (GPU) first locates any mismatch, then runs the benchmark:

0. the grouped matmul at one expert shard's shapes (``E/D`` experts: gate_up ``[E/D, 2I, H]``,
   down ``[E/D, H, I]``, 16 rows per expert), Pallas vs the XLA reference, once as shipped and
   once with the int32-offset workaround (``pallas_kernels._offsets``) switched off;
1. per token count (``--diagnose-tokens``, default 256,4096), rel. errors of the one-GPU Pallas
   forward, each EP transport with Pallas and EP with the XLA grouped matmul, against the
   one-GPU XLA reference (``jax.lax.ragged_dot``; only up to 1024 tokens: at 4096 it needs
   ~112 GiB) and against the one-GPU Pallas forward.

``NCCL_NVLS_ENABLE=0`` (NVLink multicast off) is set here unless the environment sets it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ARGS = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ARGS.add_argument("--tiny", action="store_true", help="CPU smoke test with fake devices")
ARGS.add_argument("--devices", type=int, default=2, help="expert-parallel size D")
ARGS.add_argument("--tokens", type=int, default=None, help="tokens (default 4096; tiny: 64)")
ARGS.add_argument("--format", default="fp8_block", help="expert weight format")
ARGS.add_argument("--transports", default=None, help="comma list of ragged,dense")
ARGS.add_argument("--iters", type=int, default=None, help="calls per timing repeat")
ARGS.add_argument("--out", default=None, help="append the markdown table to this file")
ARGS.add_argument("--diagnose", action="store_true", help="locate a mismatch first (see above)")
ARGS.add_argument("--diagnose-tokens", default="256,4096", help="token counts of --diagnose")


def _setup_env(args) -> None:
    """Before jax is imported: NVLink multicast off; fake CPU devices for --tiny."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.tiny:
        os.environ["JAX_PLATFORMS"] = "cpu"
        flag = "--xla_force_host_platform_device_count"
        if flag not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                       f" {flag}={max(args.devices, 2)}").strip()


if __name__ == "__main__":
    _setup_env(ARGS.parse_args())

import dataclasses  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import atlas_jax as aj  # noqa: E402
from atlas_jax.config import Format, MoEConfig  # noqa: E402
from atlas_jax.moe import parallel  # noqa: E402
from atlas_jax.moe.dispatch import permute, unpermute  # noqa: E402
from atlas_jax.quant import QTensor, quantize  # noqa: E402
from benchmarks._common import table, time_jax  # noqa: E402

DEEPSEEK_V3 = dict(hidden_size=7168, intermediate_size=2048, num_experts=256, top_k=8,
                   scoring="sigmoid", selection_bias=True, n_group=8, topk_group=4,
                   norm_topk_prob=True, norm_eps=1e-20, routed_scaling_factor=2.5,
                   shared_intermediate_size=2048)
TINY = dict(DEEPSEEK_V3, hidden_size=64, intermediate_size=32, num_experts=16, top_k=4,
            n_group=4, topk_group=2, shared_intermediate_size=32)


# ---- parameters (expert stacks made in chunks: a 256-expert f32 stack would not fit) -------------


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _expert_chunk(key, shape, fmt: Format, block) -> QTensor:
    w = jax.random.normal(key, shape, jnp.float32) / shape[-1] ** 0.5
    return quantize(w, fmt, block_size=block, dtype=jnp.bfloat16)


def _expert_stack(key, cfg: MoEConfig, n: int, k: int, chunk: int = 16) -> QTensor:
    """[E, n, k] in cfg's expert format, ~N(0, 1/k), generated ``chunk`` experts at a time."""
    e, fmt = cfg.num_experts, cfg.expert_format
    block = cfg.fp8_block if fmt is Format.FP8_BLOCK else None
    parts = [_expert_chunk(kk, (min(chunk, e - i), n, k), fmt, block)
             for i, kk in zip(range(0, e, chunk), jax.random.split(key, -(-e // chunk)),
                              strict=True)]
    stack = jax.tree_util.tree_map(lambda *a: jnp.concatenate(a), *parts)
    return dataclasses.replace(stack, shape=(e, n, k))


def make_params(cfg: MoEConfig, seed: int = 0):
    k_base, k_gu, k_dn = jax.random.split(jax.random.key(seed), 3)
    small = cfg.replace(intermediate_size=32)  # the router, biases and shared expert of cfg
    base = aj.moe.init_params(k_base, small, dtype=jnp.bfloat16)
    h, i = cfg.hidden_size, cfg.intermediate_size
    return dataclasses.replace(base, gate_up=_expert_stack(k_gu, cfg, 2 * i, h),
                               down=_expert_stack(k_dn, cfg, h, i), config=cfg)


# ---- the measured functions -------------------------------------------------------------------


def exchange_only(mesh, axis: str, cfg: MoEConfig, transport: parallel.Transport):
    """Dispatch + combine traffic of the EP forward with no expert math: ``(ids, x) -> y``,
    ids [T, k] and x [T, H] split over ``axis``."""
    d = mesh.shape[axis]

    def body(ids, x):
        p = permute(ids, cfg.num_experts)
        rows, plan = parallel.dispatch_rows(x[p.token_of_row], p.group_sizes, axis=axis,
                                            num_shards=d, transport=transport)
        back = parallel.return_rows(rows, plan, axis=axis, transport=transport)
        return unpermute(back, p).reshape(*ids.shape, -1).sum(1)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axis), P(axis)),
                                 out_specs=P(axis)))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ---- --diagnose ---------------------------------------------------------------------------------

XLA_REFERENCE_MAX_TOKENS = 1024  # jax.lax.ragged_dot over 256 experts needs ~28 MiB per token


def diagnose_kernel(params, cfg: MoEConfig, d: int, *, rows_per_expert: int = 16) -> None:
    """Step 0: ops.grouped_matmul (Pallas) vs its XLA reference on one expert shard's weights,
    with the int32-offset workaround on (as shipped) and off (the bug it works around)."""
    from atlas_jax import ops
    from atlas_jax.ops.activation import GateUp
    from pallas_kernels import _offsets

    el = cfg.num_experts // d
    pallas, xla = (aj.KernelConfig(grouped_matmul=b) for b in ("pallas", "xla"))
    shard = {name: dataclasses.replace(jax.tree_util.tree_map(lambda a: a[:el], q),
                                       shape=(el, *q.shape[1:]))
             for name, q in (("gate_up", params.gate_up), ("down", params.down))}
    m = el * rows_per_expert
    sizes = jnp.full((el,), rows_per_expert, jnp.int32)
    ex = np.arange(m) // rows_per_expert  # expert of each row
    for name, q in shard.items():
        x = jax.random.normal(jax.random.key(2), (m, q.shape[2]), jnp.bfloat16)
        epi = GateUp.of(cfg) if name == "gate_up" else None
        ref = np.asarray(ops.grouped_matmul(x, q, sizes, epilogue=epi, kernels=xla))
        saved = _offsets.INT64_INDEXED_BYTES
        for label, limit in (("as shipped", saved), ("workaround off", 0)):
            _offsets.INT64_INDEXED_BYTES = limit
            jax.clear_caches()
            try:
                out = np.asarray(ops.grouped_matmul(x, q, sizes, epilogue=epi, kernels=pallas))
            finally:
                _offsets.INT64_INDEXED_BYTES = saved
            per = [rel_err(out[ex == e], ref[ex == e]) for e in range(el)]
            bad = [e for e in range(el) if per[e] > 2e-2]
            print(f"  kernel {name} {q.format.value} {tuple(q.shape)} ({q.data.nbytes / 2**30:.2f}"
                  f" GiB), {label}: rel. error {rel_err(out, ref):.2e}; experts with error > 2e-2: "
                  f"{len(bad)}{f' (first {bad[0]}, last {bad[-1]})' if bad else ''}", flush=True)
    jax.clear_caches()


def diagnose_forward(params, sharded, mesh, cfg: MoEConfig, transports, tokens: int) -> None:
    """Step 1 at one token count: every variant against the one-GPU references."""
    d = mesh.shape["expert"]
    x = jax.random.normal(jax.random.key(3), (tokens, cfg.hidden_size), jnp.bfloat16)
    x_split = jax.device_put(x, NamedSharding(mesh, P("expert")))
    pallas, xla = (aj.KernelConfig(grouped_matmul=b) for b in ("pallas", "xla"))
    one = jax.jit(aj.moe_forward, static_argnames="kernels")  # jit: no eager f32 weight copies
    ep = jax.jit(parallel.moe_forward_parallel,
                 static_argnames=("mesh", "expert_axis", "kernels", "transport"))
    outs = {"1 GPU pallas": np.asarray(one(params, x, kernels=pallas))}
    if tokens <= XLA_REFERENCE_MAX_TOKENS:
        outs["1 GPU xla"] = np.asarray(one(params, x, kernels=xla))
    for t in transports:
        outs[f"EP={d} {t.value} pallas"] = np.asarray(
            ep(sharded, x_split, mesh, expert_axis="expert", kernels=pallas, transport=t))
    if tokens <= XLA_REFERENCE_MAX_TOKENS:
        outs[f"EP={d} {transports[0].value} xla"] = np.asarray(ep(
            sharded, x_split, mesh, expert_axis="expert", kernels=xla, transport=transports[0]))
    for ref in ("1 GPU xla", "1 GPU pallas"):
        if ref not in outs:
            continue
        for name, y in outs.items():
            if name != ref:
                err = rel_err(y, outs[ref])
                print(f"  {tokens} tokens: {name} vs {ref}: rel. error {err:.2e} "
                      f"({'ok' if err < 2e-2 else 'MISMATCH'})", flush=True)


def main(args) -> None:
    tiny = args.tiny
    d = args.devices
    tokens = args.tokens or (64 if tiny else 4096)
    iters = args.iters or (2 if tiny else 20)
    platform = jax.devices()[0].platform
    default_transports = "dense" if platform == "cpu" else "ragged,dense"
    transports = [parallel.Transport(t) for t in (args.transports or default_transports).split(",")]
    if tokens % d:
        sys.exit(f"--tokens {tokens} must be a multiple of --devices {d} (tokens are split)")
    if jax.device_count() < d:
        sys.exit(f"needs {d} devices, found {jax.device_count()} ({jax.devices()})")
    cfg = MoEConfig(**(TINY if tiny else DEEPSEEK_V3), expert_format=Format(args.format))
    name = "tiny (CPU)" if tiny else "deepseek-v3"
    print(f"# {name}: {cfg.num_experts} experts, H {cfg.hidden_size}, I {cfg.intermediate_size}, "
          f"k {cfg.top_k}, {cfg.expert_format.value}, {tokens} tokens, EP={d} on "
          f"{jax.devices()[0].device_kind} (NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')})",
          flush=True)

    params = make_params(cfg)
    x = jax.random.normal(jax.random.key(1), (tokens, cfg.hidden_size), jnp.bfloat16)
    mesh = jax.make_mesh((d,), ("expert",), devices=jax.devices()[:d])
    sharded = aj.moe.shard(params, mesh)
    x_split = jax.device_put(x, NamedSharding(mesh, P("expert")))
    ids = jax.device_put(aj.moe.route(params, x).expert_ids, NamedSharding(mesh, P("expert")))
    counts = np.bincount(np.asarray(ids).reshape(-1) // (cfg.num_experts // d), minlength=d)
    print(f"rows per device: {counts.tolist()} (max/mean {counts.max() / counts.mean():.3f})")

    if args.diagnose:
        print("diagnose 0: grouped matmul on one expert shard's weights", flush=True)
        diagnose_kernel(params, cfg, d)
        for n in (int(v) for v in args.diagnose_tokens.split(",")):
            print(f"diagnose 1: forward at {n} tokens", flush=True)
            diagnose_forward(params, sharded, mesh, cfg, transports, n)

    single = jax.jit(lambda p, x: aj.moe_forward(p, x))
    y1 = single(params, x)
    rows = []
    t1 = time_jax(single, params, x, iters=iters)
    rows.append(dict(config="1 device", us=t1 * 1e6, speedup=1.0))
    for transport in transports:
        ep = jax.jit(functools.partial(parallel.moe_forward_parallel, mesh=mesh,
                                       expert_axis="expert", transport=transport))
        err = rel_err(ep(sharded, x_split), y1)
        ok = "ok" if err < 2e-2 else "MISMATCH"
        print(f"EP={d} {transport.value}: rel. error vs 1 device {err:.2e} ({ok})", flush=True)
        t = time_jax(ep, sharded, x_split, iters=iters)
        ex = exchange_only(mesh, "expert", cfg, transport)
        t_ex = time_jax(ex, ids, x_split, iters=iters)
        rows.append({"config": f"EP={d} {transport.value}", "us": t * 1e6, "speedup": t1 / t,
                     "scaling eff": t1 / (d * t), "exchange us": t_ex * 1e6,
                     "a2a share": t_ex / t, "rel err": f"{err:.1e}"})
    cols = ["config", "us", "speedup", "scaling eff", "exchange us", "a2a share", "rel err"]
    text = (f"\n{name}, {tokens} tokens, {cfg.expert_format.value}, "
            f"{jax.devices()[0].device_kind}, {datetime.date.today()}\n\n{table(rows, cols)}\n")
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main(ARGS.parse_args())
