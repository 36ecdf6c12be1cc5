"""The paged decode's split combine, formulated several ways, timed on the GPU.

The decode kernel combines its splits in a second Pallas launch (``decode.combine_kernel``,
all splits of an output row in one load). This script times it against plain-jnp
formulations, each swapped in for that launch: ``decode.combine_splits`` (its jnp statement,
which XLA compiled into 2-4 small launches: the decode's combine until 2026-12-01) and the
alternatives below. Each jnp formulation is checked against ``combine_splits``, every step's
output against the XLA reference. Columns: the whole decode step's GPU busy time (CUPTI),
launches per call and step time.

    python benchmarks/paged_combine.py            # H200; --smoke: tiny, interpret mode (CPU)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import paged_attention as pa  # noqa: E402
from benchmarks._common import device_busy, rotating, table, time_scan  # noqa: E402
from pallas_kernels.paged_attention import DecodeConfig, decode  # noqa: E402


def _weights(lse, sinks, q_len):
    """Normalized split weights ``[B, Hk, Q*G, S]`` (S minor), the sinks as one more split
    whose output is zero; rows that saw no key and have no sink get 0."""
    b, hk, s, qg = lse.shape
    lt = jnp.moveaxis(lse, 2, -1)  # [B, Hk, QG, S]
    if sinks is not None:
        g = qg // q_len
        sink = jnp.tile(sinks.astype(jnp.float32).reshape(hk, g), (1, q_len))
        lt = jnp.concatenate([lt, jnp.broadcast_to(sink[None, :, :, None], (b, hk, qg, 1))], -1)
    mx = lt.max(-1, keepdims=True)
    mx = jnp.where(mx > -jnp.inf, mx, 0.0)
    w = jnp.exp(lt - mx)
    den = w.sum(-1, keepdims=True)
    return w[..., :s] / jnp.where(den > 0, den, 1.0)


def _out(num, q_len):
    b, hk, qg, d = num.shape
    g = qg // q_len
    return num.reshape(b, hk, q_len, g, d).transpose(0, 2, 1, 3, 4).reshape(b, q_len, hk * g, d)


def combine_weighted_sum(o, lse, sinks, *, q_len):
    """Weights first (S minor, sinks as a zero split), then one multiply-and-sum over S."""
    w = _weights(lse, sinks, q_len)  # [B, Hk, QG, S]
    return _out(jnp.sum(jnp.moveaxis(w, -1, 2)[..., None] * o, axis=2), q_len)


def combine_einsum(o, lse, sinks, *, q_len):
    """Weights first, then the sum over S as a batched matrix-vector product."""
    w = _weights(lse, sinks, q_len)
    return _out(jnp.einsum("bhqs,bhsqd->bhqd", w, o, preferred_element_type=jnp.float32), q_len)


def combine_unrolled(o, lse, sinks, *, q_len):
    """The sums and the max over S as chains of elementwise ops on the S slices: XLA fuses
    them into loop fusions (as it already does at S = 3) instead of reduction kernels."""
    b, hk, s, qg, d = o.shape
    mx = lse[:, :, 0]
    for i in range(1, s):
        mx = jnp.maximum(mx, lse[:, :, i])
    if sinks is not None:
        g = qg // q_len
        sink = jnp.tile(sinks.astype(jnp.float32).reshape(hk, g), (1, q_len))[None]
        mx = jnp.maximum(mx, sink)
    mx = jnp.where(mx > -jnp.inf, mx, 0.0)  # [B, Hk, QG]
    den = jnp.exp(sink - mx) if sinks is not None else jnp.zeros_like(mx)
    num = jnp.zeros((b, hk, qg, d), jnp.float32)
    for i in range(s):
        w = jnp.exp(lse[:, :, i] - mx)
        den = den + w
        num = num + w[..., None] * o[:, :, i]
    num = jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
    return _out(num, q_len)


VARIANTS = {"combine_splits": decode.combine_splits, "unrolled": combine_unrolled,
            "weighted_sum": combine_weighted_sum, "einsum": combine_einsum}
CASES = [(1, 32768, 32, 4, 128, "bf16"), (1, 16384, 64, 8, 128, "bf16"),
         (1, 32768, 32, 4, 128, "fp8"), (32, 4096, 32, 4, 128, "bf16")]
SMOKE_CASES = [(1, 700, 8, 2, 64, "bf16")]


def _as_launch(fn):
    """A jnp formulation in the place of ``decode.combine_pallas`` (flat partials in, flat
    ``[B * Q * Hq, D]`` rows out)."""

    def combine(o, lse, sinks, *, st, batch, out_dtype, interpret):
        del interpret
        qg = st.q_len * st.group
        o = o.reshape(batch, st.num_kv_heads, st.num_splits, qg, st.head_dim)
        lse = lse.reshape(batch, st.num_kv_heads, st.num_splits, qg)
        return fn(o, lse, sinks, q_len=st.q_len).astype(out_dtype).reshape(-1, st.head_dim)

    return combine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    pa.SMOKE = args.smoke
    rows = []
    key = jax.random.key(0)
    original = decode.combine_pallas
    for b, ctx, hq, hk, d, dtype in SMOKE_CASES if args.smoke else CASES:
        cache = pa.make_cache(key, b, ctx, hk, d, dtype)
        xs = pa.queries(key, b, hq, d)
        s, qg = 7, hq // hk
        ko, kl, ks = jax.random.split(jax.random.fold_in(key, ctx), 3)
        o = jax.random.normal(ko, (b, hk, s, qg, d), jnp.float32)
        lse = jax.random.normal(kl, (b, hk, s, qg), jnp.float32) * 3
        lse = lse.at[:, :, -2:].set(-jnp.inf)  # empty splits
        sinks = jax.random.normal(ks, (hq,), jnp.float32)
        for name in ["pallas", *args.variants]:
            row = dict(B=b, ctx=ctx, heads=f"{hq}/{hk}", kv=dtype, variant=name)
            if name != "pallas":
                fn = VARIANTS[name]
                for sk in (None, sinks):
                    want = decode.combine_splits(o, lse, sk, q_len=1)
                    err = float(jnp.max(jnp.abs(fn(o, lse, sk, q_len=1) - want)))
                    row["max_err" if sk is None else "max_err_sinks"] = err
                decode.combine_pallas = _as_launch(fn)
            jax.clear_caches()  # paged_decode is jitted: retrace it with this combine
            try:
                # interpret mode has no SM count, hence one split: ask for 3
                config = DecodeConfig(2, 3) if args.smoke else None
                fn = pa.ours_step(dtype, d, config)
                step = jax.jit(fn)
                busy = None if args.smoke else device_busy(rotating(step, cache, xs))
                if not args.smoke:
                    row["step_us"] = time_scan(fn, cache, xs, loops=8) * 1e6
                out = step(cache, xs[0])
            finally:
                decode.combine_pallas = original
                jax.clear_caches()
            ref = jax.jit(pa.ref_step(dtype, d))(cache, xs[0])
            row["step_rel_err"] = pa.rel_err(out, ref)
            if busy:
                row.update(step_busy_us=busy[0] * 1e6, launches=busy[1])
            rows.append(row)
            print(table([row], list(row)), flush=True)
    text = table(rows, list(dict.fromkeys(k for r in rows for k in r)))
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
