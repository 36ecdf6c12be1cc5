"""Expert parallelism over a ``jax.sharding.Mesh``: experts sharded over one mesh axis, tokens
split over the devices, routed rows exchanged with all-to-all collectives inside ``jax.shard_map``.

::

    params = aj.moe.shard(params, mesh, expert_axis="expert")
    y = aj.moe_forward(params, x, mesh=mesh)  # equals aj.moe_forward(params, x)

Layout. With ``D`` devices on the expert axis and ``E`` routed experts, device ``d`` owns experts
``[d * E/D, (d+1) * E/D)``: every expert-stacked leaf (the ``gate_up`` / ``down`` QTensors' data,
scale and global scale, the expert biases, ``per_expert_scale``) is split on its leading dim over
the expert axis; everything else (router, biases of the router, hash table, shared expert) is
replicated. Tokens are split over ``(data_axis, expert_axis)`` together, so every device owns a
distinct ``T_local = ceil(T / devices)`` tokens (``T`` is padded to a multiple; padded tokens
are never dispatched). Experts are replicated over ``data_axis``; each all-to-all runs inside one
group of devices that share a data index.

Per device, inside ``jax.shard_map`` (``_expert_parallel_body``):

1. route its ``T_local`` tokens with the single-device :func:`route` (same function, same
   numbers); zero experts (LongCat, ids >= E) and padded tokens are never sent: they are
   handled on the source device by :func:`combine` (identity);
2. sort its ``T_local * k`` (token, slot) pairs by expert (:func:`permute`): the rows bound for
   device ``d`` are then one contiguous slice;
3. exchange per-(destination, local expert) row counts with one small ``all_to_all``, then the
   rows themselves (ragged, one slice per destination);
4. on the expert device: reorder the received rows (grouped by source) to expert-major order and
   run the two :func:`ops.grouped_matmul` s over the local experts with the local group sizes;
5. send the results back the same way (the inverse exchange), un-sort, and :func:`combine` in
   float32 with the routing weights; the shared expert runs on the device's own tokens.

Transport (``Transport``). ``RAGGED`` uses ``jax.lax.ragged_all_to_all`` (GPU, TPU): only the
routed rows travel. ``DENSE`` emulates the same ragged exchange with a dense
``jax.lax.all_to_all`` of a fixed per-destination capacity equal to the worst case
``T_local * k`` rows (dropless; it moves ``D * T_local * k`` rows per device). Both run the same
bookkeeping and give the same numbers. ``AUTO`` picks ``DENSE``: XLA:CPU does not implement
ragged-all-to-all (jax 0.11.2: "HLO opcode ragged-all-to-all is not supported by XLA:CPU
ThunkEmitter"), and on 2 x H200 (jax 0.11.2, NCCL) the ragged exchange of a DeepSeek-V3 layer at
4096 tokens took 101 ms against 8.3 ms for the dense one (benchmarks/RESULTS.md).

Rows travel in the activation dtype and come back in the matmuls' operand dtype (float32 for
float32 activations, bfloat16 otherwise); the combine accumulates in float32 as on one device.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from atlas_jax import ops
from atlas_jax._checks import check_in_range
from atlas_jax._safetensors import DTYPES, CheckpointError
from atlas_jax.config import KernelConfig, MoEConfig, MoEPath
from atlas_jax.moe.dispatch import combine, permute, unpermute
from atlas_jax.moe.experts import act_quants, shared_experts
from atlas_jax.moe.params import MoEParams
from atlas_jax.moe.routing import (
    Routing,
    check_token_ids,
    check_tokens,
    rms_normalize,
    route,
)
from atlas_jax.ops.activation import GateUp
from atlas_jax.ops.grouped_matmul import compute_dtype
from atlas_jax.quant import QTensor

__all__ = ["EXPERT_FIELDS", "ExchangePlan", "Transport", "dispatch_rows", "load_expert_shard",
           "load_moe_layer_sharded", "moe_forward_parallel", "param_specs", "return_rows", "shard"]

# MoEParams fields whose leading dim is the routed expert (split over the expert axis).
EXPERT_FIELDS = ("gate_up", "down", "gate_up_bias", "down_bias", "per_expert_scale")


class Transport(enum.Enum):
    """How routed rows travel between the devices of the expert axis."""

    AUTO = "auto"  # DENSE (measured faster on GPU; CPU has no ragged-all-to-all)
    RAGGED = "ragged"  # jax.lax.ragged_all_to_all: only the routed rows travel
    DENSE = "dense"  # jax.lax.all_to_all of a fixed worst-case capacity (T_local * k) per peer


# ---- mesh / axis validation ---------------------------------------------------------------------


def _check_mesh(mesh: Any, who: str) -> Mesh:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{who}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    return mesh


def _check_axis(mesh: Mesh, name: Any, arg: str, who: str) -> str:
    if name not in mesh.axis_names:
        raise ValueError(f"{who}: {arg}={name!r} is not an axis of the mesh; its axes are "
                         f"{tuple(mesh.axis_names)}")
    return name


def _check_axes(mesh: Mesh, cfg: MoEConfig, expert_axis: Any, data_axis: Any,
                who: str) -> tuple[str, str | None, int]:
    """Validated (expert_axis, data_axis, expert-axis size)."""
    _check_axis(mesh, expert_axis, "expert_axis", who)
    if data_axis is not None:
        _check_axis(mesh, data_axis, "data_axis", who)
        if data_axis == expert_axis:
            raise ValueError(f"{who}: data_axis and expert_axis must differ, both are "
                             f"{expert_axis!r}")
    d = mesh.shape[expert_axis]
    if cfg.num_experts % d:
        raise ValueError(f"{who}: num_experts={cfg.num_experts} must be divisible by the size "
                         f"of mesh axis {expert_axis!r}, got {d}")
    return expert_axis, data_axis, d


def _default_expert_axis(params: MoEParams, mesh: Mesh) -> str:
    """The axis ``shard`` put the experts on (read from concrete params), else ``"expert"``
    when the mesh has it, else the mesh's only axis."""
    data = params.gate_up.data
    sharding = getattr(data, "sharding", None) if isinstance(data, jax.Array) else None
    if isinstance(sharding, NamedSharding) and sharding.mesh == mesh and sharding.spec:
        lead = sharding.spec[0]
        if isinstance(lead, str):
            return lead
    if "expert" in mesh.axis_names:
        return "expert"
    if len(mesh.axis_names) == 1:
        return mesh.axis_names[0]
    raise ValueError(f"moe_forward: pass expert_axis=: the mesh has axes "
                     f"{tuple(mesh.axis_names)} and none is named 'expert'")


# ---- placement -------------------------------------------------------------------------------


def param_specs(params: MoEParams, expert_axis: str) -> dict[str, P]:
    """PartitionSpec of every present field (QTensor fields: one spec for all its leaves)."""
    return {name: P(expert_axis) if name in EXPERT_FIELDS else P()
            for name, value in _fields(params).items()}


def _fields(params: MoEParams) -> dict[str, Any]:
    """The present array / QTensor fields of ``params`` by name (config excluded)."""
    out = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if f.name != "config" and value is not None:
            out[f.name] = value
    return out


def shard(params: MoEParams, mesh: Mesh, expert_axis: str = "expert", *,
          data_axis: str | None = None) -> MoEParams:
    """Place ``params`` on ``mesh`` for the expert-parallel forward: expert-stacked leaves split
    on their leading dim over ``expert_axis`` (replicated over any other axis, e.g.
    ``data_axis``), all other leaves replicated. ``num_experts`` must divide by the axis size."""
    if not isinstance(params, MoEParams):
        raise TypeError(f"shard: params must be MoEParams, got {type(params).__name__}")
    mesh = _check_mesh(mesh, "shard")
    _check_axes(mesh, params.config, expert_axis, data_axis, "shard")
    specs = param_specs(params, expert_axis)
    placed = {name: jax.device_put(value, NamedSharding(mesh, specs[name]))
              for name, value in _fields(params).items()}
    return dataclasses.replace(params, **placed)


def _check_placed(params: MoEParams, mesh: Mesh, expert_axis: str) -> None:
    """Concrete expert leaves must already be split over ``expert_axis`` (no silent per-call
    resharding of the whole expert stack)."""
    want = NamedSharding(mesh, P(expert_axis))
    for name in EXPERT_FIELDS:
        for leaf in jax.tree_util.tree_leaves(getattr(params, name)):
            if isinstance(leaf, jax.core.Tracer) or not isinstance(leaf, jax.Array):
                continue
            if not leaf.sharding.is_equivalent_to(want, leaf.ndim):
                raise ValueError(
                    f"moe_forward: params.{name} is not split over mesh axis {expert_axis!r} "
                    f"(its sharding is {leaf.sharding}); call "
                    f"aj.moe.shard(params, mesh, expert_axis={expert_axis!r}) first")


# ---- the forward ---------------------------------------------------------------------------------


def _resolve_transport(transport: Transport | str, mesh: Mesh) -> Transport:
    try:
        transport = Transport(transport)
    except ValueError:
        allowed = ", ".join(repr(t.value) for t in Transport)
        raise ValueError(f"moe_forward: transport={transport!r}, expected one of {allowed}"
                         ) from None
    platform = mesh.devices.flat[0].platform
    if transport is Transport.AUTO:
        return Transport.DENSE
    if transport is Transport.RAGGED and platform == "cpu":
        raise NotImplementedError("transport='ragged': XLA:CPU does not implement "
                                  "ragged-all-to-all; use 'dense' (or 'auto') on CPU")
    return transport


def moe_forward_parallel(
    params: MoEParams,
    x: jax.Array,  # [T, H] or [B, S, H]
    mesh: Mesh,
    *,
    expert_axis: str | None = None,  # None: the axis ``shard`` used (or "expert")
    data_axis: str | None = None,  # tokens are split over (data_axis, expert_axis)
    token_ids: jax.Array | None = None,  # [T] or [B, S], hash-routing layers only
    kernels: KernelConfig | None = None,
    transport: Transport | str = Transport.AUTO,
) -> jax.Array:  # same shape and dtype as x
    """Expert-parallel :func:`moe_forward` over ``mesh`` (see the module docstring)."""
    if not isinstance(params, MoEParams):
        raise TypeError(f"moe_forward: params must be MoEParams, got {type(params).__name__}")
    mesh = _check_mesh(mesh, "moe_forward")
    kernels = kernels or KernelConfig()
    if kernels.moe_path is MoEPath.DECODE:
        raise NotImplementedError("moe_path='decode' with a mesh: the expert-parallel forward "
                                  "always dispatches rows to the expert devices (no decode "
                                  "variant); use 'auto' or 'prefill'")
    cfg = params.config
    if expert_axis is None:
        expert_axis = _default_expert_axis(params, mesh)
    _check_axes(mesh, cfg, expert_axis, data_axis, "moe_forward")
    transport = _resolve_transport(transport, mesh)
    x2 = check_tokens(x, cfg)
    if x2.shape[0] == 0:
        return jnp.zeros_like(x)
    token_ids = check_token_ids(token_ids, cfg, x2.shape[0])
    if cfg.hash_routing:
        token_ids = token_ids.astype(jnp.int32)
        check_in_range(token_ids, cfg.hash_vocab_size, "token_ids", "the hash table's vocabulary")
    else:
        token_ids = None
    _check_placed(params, mesh, expert_axis)
    return _forward(params, x2, token_ids, mesh=mesh, expert_axis=expert_axis,
                    data_axis=data_axis, kernels=kernels, transport=transport,
                    out_shape=tuple(x.shape))


@functools.partial(jax.jit, static_argnames=("mesh", "expert_axis", "data_axis", "kernels",
                                             "transport", "out_shape"))
def _forward(params: MoEParams, x: jax.Array, token_ids: jax.Array | None, *, mesh: Mesh,
             expert_axis: str, data_axis: str | None, kernels: KernelConfig,
             transport: Transport, out_shape: tuple[int, ...]) -> jax.Array:
    """Pad tokens to the device count, place, run the body under ``shard_map``. Returns
    ``out_shape`` ([T, H] stays split over the token axes when T divides evenly)."""
    cfg = params.config
    tok_axes = (data_axis, expert_axis) if data_axis is not None else (expert_axis,)
    n_dev = math.prod(mesh.shape[a] for a in tok_axes)
    t = x.shape[0]
    t_pad = -(-t // n_dev) * n_dev
    tok = P(tok_axes)

    place = functools.partial(_place, mesh=mesh)

    xp = place(jnp.pad(x, ((0, t_pad - t), (0, 0))), tok)
    valid = place(jnp.arange(t_pad) < t, tok)
    tids = None if token_ids is None else place(jnp.pad(token_ids, (0, t_pad - t)), tok)
    specs = param_specs(params, expert_axis)
    fields = {name: jax.tree_util.tree_map(lambda a, s=specs[name]: place(a, s), value)
              for name, value in _fields(params).items()}
    body = functools.partial(
        _expert_parallel_body, cfg=cfg, axis=expert_axis, num_shards=mesh.shape[expert_axis],
        kernels=kernels, transport=transport)
    # check_vma=False: the Pallas kernels inside declare plain output shapes, which shard_map's
    # varying-manual-axes check rejects ("manual_axis_type ... must not be None").
    fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, tok, tok, None if tids is None else tok),
                       out_specs=tok, check_vma=False)
    y = fn(fields, xp, valid, tids)  # [T_pad, H] split over tok_axes
    if t_pad == t and len(out_shape) == 2:
        return y
    # An uneven token count, or [B, S, H], cannot stay split over the devices: replicate.
    return place(y, P())[:t].reshape(out_shape)


def _place(a: jax.Array, spec: P, *, mesh: Mesh) -> jax.Array:
    """Constrain ``a`` to ``spec`` under jit: ``jax.reshard`` on Explicit mesh axes (the
    default of ``jax.make_mesh``), ``with_sharding_constraint`` on Auto ones."""
    used = [n for part in spec if part is not None
            for n in (part if isinstance(part, tuple) else (part,))]
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    explicit = [types[n] == AxisType.Explicit for n in used]
    sharding = NamedSharding(mesh, spec)
    if all(explicit) and (used or any(t == AxisType.Explicit for t in types.values())):
        return jax.reshard(a, sharding)
    return jax.lax.with_sharding_constraint(a, sharding)


@dataclasses.dataclass(frozen=True)
class _Replicated:
    """The replicated MoEParams fields that routing and the shared expert read, under their
    MoEParams names (``route`` / ``shared_experts`` read only these and ``config``)."""

    router: jax.Array
    router_bias: jax.Array | None
    selection_bias: jax.Array | None
    tid2eid: jax.Array | None
    router_scale: jax.Array | None
    per_expert_scale: jax.Array | None
    shared_gate_up: QTensor | None
    shared_down: QTensor | None
    shared_gate: jax.Array | None
    config: MoEConfig


def _exclusive_cumsum(a: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.cumsum(a, axis=axis) - a


def _expert_parallel_body(fields: dict[str, Any], x: jax.Array, valid: jax.Array,
                          token_ids: jax.Array | None, *, cfg: MoEConfig, axis: str,
                          num_shards: int, kernels: KernelConfig,
                          transport: Transport) -> jax.Array:
    """One device: route its tokens, exchange rows, local experts, exchange back, combine.

    ``x`` [Tl, H] its tokens, ``valid`` [Tl] (False: padding), expert-stacked fields hold its
    ``El = E / D`` experts. Returns [Tl, H] in x's dtype.
    """
    d, e = num_shards, cfg.num_experts
    el = e // d
    get = fields.get
    pes = get("per_expert_scale")
    if pes is not None:  # routing scales every weight by its expert's entry: needs all E
        pes = jax.lax.all_gather(pes, axis, tiled=True)
    rep = _Replicated(get("router"), get("router_bias"), get("selection_bias"), get("tid2eid"),
                      get("router_scale"), pes, get("shared_gate_up"), get("shared_down"),
                      get("shared_gate"), cfg)
    r = route(rep, x, token_ids, kernels=kernels)  # the single-device router, this device's tokens
    ids = jnp.where(valid[:, None], r.expert_ids, e)  # padding tokens: never dispatched
    xe = x
    if get("pre_expert_norm") is not None:
        xe = (rms_normalize(x, cfg.rms_norm_eps) * get("pre_expert_norm").astype(jnp.float32)
              ).astype(x.dtype)

    # Sort pairs by expert: rows for device j are one slice; zero experts sort last, unsent.
    p = permute(ids, e)
    rows, plan = dispatch_rows(xe[p.token_of_row], p.group_sizes, axis=axis, num_shards=d,
                               transport=transport)  # [D*n, H] expert-major, local experts
    y = _local_experts(rows, fields, plan.group_sizes, cfg, el, kernels)  # [D*n, H] f32
    back = return_rows(y.astype(compute_dtype(x)), plan, axis=axis, transport=transport)

    out = combine(unpermute(back, p), xe, Routing(ids, r.weights), e)  # [Tl, H] f32
    if rep.shared_gate_up is not None:
        out = out + shared_experts(rep, xe)
    return out.astype(x.dtype)


class ExchangePlan(NamedTuple):
    """What ``return_rows`` needs to send ``dispatch_rows``' rows back (per device)."""

    send: jax.Array  # [D] rows sent to each device
    send_offsets: jax.Array  # [D] where they start in the sorted rows
    recv: jax.Array  # [D] rows received from each device
    recv_offsets: jax.Array  # [D] where they start in the receive buffer
    positions: jax.Array  # [D*n] expert-major position of each receive-buffer row
    group_sizes: jax.Array  # [El] received rows per local expert


def dispatch_rows(xs: jax.Array, group_sizes: jax.Array, *, axis: str, num_shards: int,
                  transport: Transport) -> tuple[jax.Array, ExchangePlan]:
    """Inside ``shard_map``: send rows sorted by global expert (``xs [n, H]``, ``group_sizes
    [E]`` rows per expert, rows past their sum unsent) to the devices of ``axis`` owning their
    experts. Returns the received rows ``[D*n, H]`` in expert-major order over this device's
    ``El`` experts (rows past ``plan.group_sizes.sum()`` are zero) and the plan to send results
    back. ``transport`` must be resolved (RAGGED or DENSE)."""
    d = num_shards
    n, h = xs.shape
    counts = group_sizes.reshape(d, -1)  # [D(dst), El] rows I send to each (device, expert)
    recv_counts = jax.lax.all_to_all(counts, axis, 0, 0, tiled=True)  # [D(src), El]
    send, recv = counts.sum(1), recv_counts.sum(1)  # [D], [D]
    send_off = _exclusive_cumsum(send)  # my slice for device j starts here in xs
    recv_off = _exclusive_cumsum(recv)  # source s's rows land here in my buffer
    buf = _exchange(xs, jnp.zeros((d * n, h), xs.dtype), send_off, send, recv_off, recv,
                    axis=axis, transport=transport, cap=n)
    pos = _expert_major_positions(recv_counts, d * n)  # [D*n] row -> expert-major position
    rows = jnp.zeros_like(buf).at[pos].set(buf, unique_indices=True)
    return rows, ExchangePlan(send, send_off, recv, recv_off, pos, recv_counts.sum(0))


def return_rows(y: jax.Array, plan: ExchangePlan, *, axis: str,
                transport: Transport) -> jax.Array:
    """Inverse of ``dispatch_rows``: ``y [D*n, H]`` (expert-major, one row per received row)
    back to the devices that sent them, in their sorted order: ``[n, H]``, zero past the rows
    they sent."""
    n = y.shape[0] // plan.send.shape[0]
    y = y[plan.positions]  # back to source-grouped order
    return _exchange(y, jnp.zeros((n, *y.shape[1:]), y.dtype), plan.recv_offsets, plan.recv,
                     plan.send_offsets, plan.send, axis=axis, transport=transport, cap=n)


def _expert_major_positions(recv_counts: jax.Array, size: int) -> jax.Array:
    """Received rows are grouped by source, each source's rows sorted by local expert
    (``recv_counts [D(src), El]``); return each buffer row's position in expert-major order
    (all rows of local expert 0 from every source, then expert 1, ...). Rows past the received
    total (padding) keep their position."""  # -> [size] int32, a permutation
    d, el = recv_counts.shape
    flat = recv_counts.reshape(-1)  # segments in buffer order: (src, expert), src-major
    seg_start = _exclusive_cumsum(flat)  # [D*El]
    row = jnp.arange(size, dtype=jnp.int32)
    seg = jnp.searchsorted(jnp.cumsum(flat), row, side="right")  # [size]; D*El for padding
    seg_c = jnp.minimum(seg, d * el - 1)
    src, ex = seg_c // el, seg_c % el
    expert_start = _exclusive_cumsum(recv_counts.sum(0))  # [El]
    before = _exclusive_cumsum(recv_counts, axis=0)  # [D, El] rows of expert e from sources < s
    pos = expert_start[ex] + before[src, ex] + (row - seg_start[seg_c])
    return jnp.where(seg < d * el, pos, row).astype(jnp.int32)


def _local_experts(rows: jax.Array, fields: dict[str, Any], group_sizes: jax.Array,
                   cfg: MoEConfig, el: int, kernels: KernelConfig) -> jax.Array:
    """The two grouped matmuls of ``routed_experts_prefill`` over this device's experts."""
    gate_up, down = (_local_qtensor(fields[name], el) for name in ("gate_up", "down"))
    quant = act_quants(cfg, gate_up.format)
    a = ops.grouped_matmul(rows, gate_up, group_sizes, bias=fields.get("gate_up_bias"),
                           epilogue=GateUp.of(cfg), kernels=kernels,
                           act_quant=quant["gate_up_act_quant"])  # [M, I] f32
    a = a.astype(compute_dtype(rows))
    return ops.grouped_matmul(a, down, group_sizes, bias=fields.get("down_bias"),
                              kernels=kernels, act_quant=quant["down_act_quant"])  # [M, H] f32


def _local_qtensor(q: QTensor, el: int) -> QTensor:
    """Inside shard_map the leaves hold ``el`` experts; the static shape still says ``E``."""
    return dataclasses.replace(q, shape=(el, *q.shape[1:]))


def _exchange(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
              send_sizes: jax.Array, output_offsets_local: jax.Array, recv_sizes: jax.Array,
              *, axis: str, transport: Transport, cap: int) -> jax.Array:
    """Ragged all-to-all with one slice per peer: slice ``j`` of ``operand``
    (``input_offsets[j]``, ``send_sizes[j]`` rows) goes to device ``j``; the rows from device
    ``s`` (``recv_sizes[s]``) are written into ``output`` at ``output_offsets_local[s]`` (the
    receiver's own offsets; the sender-side offsets ``ragged_all_to_all`` wants are exchanged
    here). ``cap`` bounds every slice (DENSE's fixed capacity)."""
    i32 = lambda a: a.astype(jnp.int32)  # noqa: E731
    # Where my slice for device j lands on j: j's local offset for me.
    output_offsets = jax.lax.all_to_all(i32(output_offsets_local), axis, 0, 0, tiled=True)
    match transport:
        case Transport.RAGGED:
            return jax.lax.ragged_all_to_all(
                operand, output, i32(input_offsets), i32(send_sizes), output_offsets,
                i32(recv_sizes), axis_name=axis)
        case Transport.DENSE:
            d = input_offsets.shape[0]
            slot = jnp.arange(cap, dtype=jnp.int32)
            take = input_offsets[:, None] + slot  # [D, cap] rows of each outgoing slice
            ok = slot < send_sizes[:, None]
            chunks = jnp.where(ok[..., None], operand[jnp.where(ok, take, 0)], 0)  # [D, cap, H]
            got = jax.lax.all_to_all(chunks.reshape(d * cap, *operand.shape[1:]), axis, 0, 0,
                                     tiled=True)  # [D*cap, H], block s from device s
            dst = jnp.where(slot < recv_sizes[:, None], output_offsets_local[:, None] + slot,
                            output.shape[0])  # out of range: dropped
            return output.at[dst.reshape(-1)].set(got, mode="drop")
    raise ValueError(f"transport: {transport!r}")


# ---- loading straight to devices ----------------------------------------------------------------

_PER_EXPERT = re.compile(r"^(?P<pre>.*\.experts\.)(?P<index>\d+)\.(?P<rest>.+)$")
_FUSED_EXPERTS = re.compile(r"\.experts\.[A-Za-z_]")  # experts.gate_up_proj[_blocks|_bias|...]


class _ExpertShardView:
    """A Checkpoint seen by one expert shard ``[lo, hi)``: per-expert tensors
    ``...experts.{j}.*`` are renamed ``...experts.{lo + j}.*`` (and absent for ``j >= hi - lo``),
    fused expert stacks ``...experts.<name>`` ``[E, ...]`` are read as rows ``[lo, hi)`` only,
    every other tensor is read once through ``cache`` (shared by the shards)."""

    def __init__(self, ck, lo: int, hi: int, cache: dict[str, np.ndarray]):
        self._ck, self._lo, self._hi, self._cache = ck, lo, hi, cache
        self.config = ck.config
        self._where = ck._where  # mappers' error messages look at the tensor names

    def _rename(self, name: str) -> str | None:
        m = _PER_EXPERT.match(name)
        if m is None:
            return name
        j = int(m["index"])
        if j >= self._hi - self._lo:
            return None
        return f"{m['pre']}{self._lo + j}.{m['rest']}"

    def has(self, name: str) -> bool:
        real = self._rename(name)
        return real is not None and self._ck.has(real)

    def get(self, name: str) -> np.ndarray:
        real = self._rename(name)
        if real is None:
            raise CheckpointError(f"{name}: outside this shard's {self._hi - self._lo} experts")
        if real != name:
            return self._ck.get(real)
        if _FUSED_EXPERTS.search(name):
            return _read_rows(self._ck, name, self._lo, self._hi)
        if name not in self._cache:
            self._cache[name] = self._ck.get(name)
        return self._cache[name]


def _read_rows(ck, name: str, lo: int, hi: int) -> np.ndarray:
    """Rows ``[lo, hi)`` of the leading dim of tensor ``name``, reading only their bytes."""
    if not ck.has(name):
        return ck.get(name)  # raises CheckpointError naming the file
    f = ck._file(name)
    dtype_name, shape = f.info(name)
    if not shape or not 0 <= lo < hi <= shape[0]:
        raise CheckpointError(f"{name}: expected a leading expert dim covering [{lo}, {hi}), "
                              f"got shape {list(shape)}")
    dtype = np.dtype(DTYPES[dtype_name])
    row = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
    start = f.data_start + f.entries[name]["data_offsets"][0] + lo * row
    with open(f.path, "rb") as fh:
        fh.seek(start)
        buf = fh.read((hi - lo) * row)
    if len(buf) != (hi - lo) * row:
        raise CheckpointError(f"{f.path}: truncated while reading {name!r}")
    f.reads += 1
    return np.frombuffer(buf, dtype=dtype).reshape(hi - lo, *shape[1:])


def _shard_reading_config(cfg: MoEConfig, num_local: int) -> MoEConfig:
    """``cfg`` with ``num_local`` experts, for the mappers' per-expert loops (selection fields
    relaxed so that it validates; only the reading uses it)."""
    return cfg.replace(num_experts=num_local, n_group=1, topk_group=1,
                       top_k=min(cfg.top_k, num_local + cfg.num_zero_experts))


def load_expert_shard(path, layer: int, shard_index: int, num_shards: int, *,
                      cache: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """The MoEParams fields of ``layer`` with expert-stacked ones holding only experts
    ``[shard_index * E/num_shards, (shard_index + 1) * E/num_shards)``, read from only those
    experts' tensors (fused ``[E, ...]`` stacks: only those rows). Non-expert tensors are read
    through ``cache`` (pass one dict to several calls to read them once). The expert QTensors'
    static shape says the local count."""
    from atlas_jax import checkpoint as C

    ck = path if isinstance(path, C.Checkpoint) else C.Checkpoint(path)
    prefix = ck.layer(layer)
    cfg = C.moe_config(ck, layer)
    if not (isinstance(num_shards, int) and num_shards > 0 and cfg.num_experts % num_shards == 0):
        raise ValueError(f"num_shards={num_shards!r} must be a positive divisor of "
                         f"num_experts={cfg.num_experts}")
    if not (isinstance(shard_index, int) and 0 <= shard_index < num_shards):
        raise ValueError(f"shard_index={shard_index!r} must be in [0, {num_shards})")
    el = cfg.num_experts // num_shards
    view = _ExpertShardView(ck, shard_index * el, (shard_index + 1) * el,
                            {} if cache is None else cache)
    mapper = C._MOE_MAPPERS[ck.config.get("model_type")]
    fields = mapper(view, prefix, _shard_reading_config(cfg, el))
    lo = shard_index * el
    for name in EXPERT_FIELDS[2:]:  # fused stacks come as [El, ...]; small [E] ones are sliced
        value = fields.get(name)
        if value is None or np.shape(value)[0] == el:
            continue
        if np.shape(value)[0] != cfg.num_experts:
            raise ValueError(f"{prefix}{name}: expected {el} local or {cfg.num_experts} experts, "
                             f"got shape {np.shape(value)}")
        fields[name] = value[lo:lo + el]  # e.g. Gemma-4's router.per_expert_scale [E]
    return fields


def load_moe_layer_sharded(path, layer: int, mesh: Mesh, expert_axis: str = "expert", *,
                           data_axis: str | None = None) -> MoEParams:
    """``aj.checkpoint.load_moe_layer(path, layer)`` placed as ``shard(..., mesh, expert_axis)``
    places it, but built shard by shard: each expert shard is read from only its experts'
    tensors (:func:`load_expert_shard`), built on its own device and copied to the devices
    that replicate it; the full expert stack never exists on the host or on one device.
    Non-expert tensors are read once and replicated. Only this process's devices are read for.
    """
    from atlas_jax import checkpoint as C

    mesh = _check_mesh(mesh, "load_moe_layer_sharded")
    ck = path if isinstance(path, C.Checkpoint) else C.Checkpoint(path)
    cfg = C.moe_config(ck, layer)
    _, _, d = _check_axes(mesh, cfg, expert_axis, data_axis, "load_moe_layer_sharded")
    el = cfg.num_experts // d
    sharding = NamedSharding(mesh, P(expert_axis))
    # Which shard each addressable device holds (its slice of a [E] axis split this way).
    owners: dict[int, list] = {}
    for dev, idx in sharding.addressable_devices_indices_map((cfg.num_experts,)).items():
        owners.setdefault((idx[0].start or 0) // el, []).append(dev)
    cache: dict[str, np.ndarray] = {}
    per_device: dict[str, dict] = {}  # field -> device -> local pytree (QTensor or array)
    local: dict[str, Any] = {}
    first: dict[str, Any] | None = None
    for s in sorted(owners):
        devices = owners[s]
        with jax.default_device(devices[0]):  # constructors' jnp arrays land on the owner
            fields = load_expert_shard(ck, layer, s, d, cache=cache)
        if first is None:
            first = fields
        for name in EXPERT_FIELDS:
            value = fields.get(name)
            if value is None:
                continue
            local[name] = value
            per_device.setdefault(name, {}).update(
                {dev: jax.device_put(value, dev) for dev in devices})
    assert first is not None
    per_device = _match_global_segments(per_device)
    out: dict[str, Any] = {}
    for name, value in first.items():
        if value is None:
            continue
        if name in per_device:
            out[name] = _assemble(per_device[name], local[name], cfg.num_experts, sharding)
        else:
            out[name] = jax.device_put(value, NamedSharding(mesh, P()))
    shared = out.get("shared_gate_up")
    cfg = cfg.replace(expert_format=out["gate_up"].format,
                      shared_expert_format=shared.format if shared is not None else None)
    return C.build_moe_params(out, cfg, ck.layer(layer))


def _assemble(by_device: dict, template: Any, num_experts: int,
              sharding: NamedSharding) -> Any:
    """Global ``[E, ...]`` arrays from per-device local pytrees (one shard each)."""
    devices = list(by_device)
    trees = [by_device[dev] for dev in devices]
    leaves = [jax.tree_util.tree_leaves(t) for t in trees]
    treedef = jax.tree_util.tree_structure(trees[0])
    glob = []
    for i, leaf in enumerate(leaves[0]):
        shapes = {tuple(ls[i].shape) for ls in leaves}
        if len(shapes) != 1:
            raise ValueError(f"expert shards disagree on a leaf's shape: {sorted(shapes)}")
        shape = (num_experts, *leaf.shape[1:])
        glob.append(jax.make_array_from_single_device_arrays(
            shape, sharding, [ls[i] for ls in leaves]))
    tree = jax.tree_util.tree_unflatten(treedef, glob)
    if isinstance(template, QTensor):
        tree = dataclasses.replace(tree, shape=(num_experts, *template.shape[1:]))
    return tree


def _match_global_segments(per_device: dict[str, dict]) -> dict[str, dict]:
    """NVFP4 gate|up fusion keeps one global segment per expert where gate's and up's globals
    are equal, else two: shards may disagree. Repeat single segments to the widest count
    (row n uses segment n // (N // R): repeating is exact)."""
    for name, by_dev in per_device.items():
        qs = list(by_dev.values())
        if not isinstance(qs[0], QTensor) or qs[0].global_scale is None:
            continue
        r = max(q.global_scale.shape[-1] for q in qs)
        for dev, q in by_dev.items():
            have = q.global_scale.shape[-1]
            if have != r:
                if r % have:
                    raise ValueError(f"{name}: expert shards have {have} and {r} NVFP4 global "
                                     f"segments; cannot align them")
                g = jnp.repeat(q.global_scale, r // have, axis=-1)
                by_dev[dev] = dataclasses.replace(q, global_scale=jax.device_put(g, dev))
    return per_device
