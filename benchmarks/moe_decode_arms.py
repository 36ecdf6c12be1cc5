"""Same-run A/B of the MoE decode kernels' tuning constants: each arm sets module constants,
clears JAX's caches and times the full jitted ``moe_forward`` decode step (the GPU's busy time
by CUPTI and the marginal step in a scan, as ``moe_decode.py``, with the lowest SM clock and
the highest power ``nvidia-smi`` read while the step's calls ran); the arms run in turn for
``--repeats`` rounds inside one process, on layers made once, so that drift shows as spread
between rounds and not as a difference between arms (the device README's METHOD.md).

    python benchmarks/moe_decode_arms.py --shape qwen3-30b-a3b --formats nvfp4 mxfp4 \\
        --tokens 8 32 --arms "" "FP4_PARTS=4" "EPILOGUE_LOADS_AHEAD=False SCALE_PREFETCH=2"
    python benchmarks/moe_decode_arms.py --tiny      # CPU smoke test: tiny shape, interpret mode

An arm is a space-separated list of ``NAME=VALUE`` (a Python literal); ``NAME`` is a constant
of ``pallas_kernels.moe_decode.mosaic``, ``routing.NAME`` one of ``atlas_jax.moe.routing``, or
``rows.NAME`` one of ``pallas_kernels.moe_decode.rows``.
The empty arm is the code as it is. Constants an arm does not name keep the code's values.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import atlas_jax as aj  # noqa: E402
from atlas_jax.moe import routing  # noqa: E402
from benchmarks import moe_decode as md  # noqa: E402
from benchmarks._common import clock_samples, hbm_copy_bandwidth, table  # noqa: E402
from pallas_kernels.moe_decode import mosaic  # noqa: E402
from pallas_kernels.moe_decode import rows as row_launches  # noqa: E402

MODULES = {"mosaic": mosaic, "routing": routing, "rows": row_launches}
COLUMNS = ["shape", "format", "tokens", "arm", "round", "busy_us", "step_us", "busy_frac_hbm",
           "frac_hbm", "sm_mhz_min", "power_w_max", "rel_err", "ok"]
TOLERANCE = 1e-2  # moe_decode.py's check: the XLA decode path rounds FP8 / NVFP4 h its own way


def parse_arm(text: str) -> dict[tuple[str, str], object]:
    """``"A=1 routing.B=2"`` -> ``{("mosaic", "A"): 1, ("routing", "B"): 2}``; unknown
    constants and values that are not Python literals raise ``ValueError``."""
    out = {}
    for item in text.split():
        name, sep, value = item.partition("=")
        module, _, attr = name.rpartition(".")
        module = module or "mosaic"
        if not sep or module not in MODULES:
            raise ValueError(f"arm item {item!r}: expected NAME=VALUE, routing.NAME=VALUE "
                             "or rows.NAME=VALUE")
        if not hasattr(MODULES[module], attr) or not attr.isupper():
            raise ValueError(f"arm item {item!r}: {module} has no constant {attr}")
        try:
            out[(module, attr)] = ast.literal_eval(value)
        except (ValueError, SyntaxError) as err:
            raise ValueError(f"arm item {item!r}: {value!r} is not a Python literal") from err
    return out


def set_constants(values: dict[tuple[str, str], object]) -> None:
    """Set ``parse_arm``'s constants: each arm's in turn here, and the ``--set`` of the one-off
    tools (``moe_decode_hlo.py``, ``moe_decode_mosaic.py``) for the rest of the process."""
    for (module, attr), v in values.items():
        setattr(MODULES[module], attr, v)


def arm_argument(text: str) -> dict[tuple[str, str], object]:
    """``--set``'s argparse type: ``parse_arm``, its errors as argparse's (exit 2)."""
    try:
        return parse_arm(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def run_arms(shape: str, formats, token_counts, arms: list[str], *, repeats: int, loops: int,
             hbm: float) -> list[dict]:
    """One row a (format, tokens, round, arm), the arms in turn inside each round; in the
    first round each arm's step output (the first token set) against the XLA decode path's
    (``rel_err``; ``ok`` within ``TOLERANCE``), so an arm that times well but computes
    wrong shows."""
    parsed = [parse_arm(a) for a in arms]
    names = {key for p in parsed for key in p}
    code = {key: getattr(MODULES[key[0]], key[1]) for key in names}
    rows = []
    try:
        for fmt in formats:
            p = md.make_layer(shape, fmt)
            per_expert, shared = md.expert_bytes(p), md.shared_bytes(p)
            for tokens in token_counts:
                xs = md.token_sets(tokens, p.config.hidden_size)
                _, nbytes = md.step_bytes(p, xs, per_expert, shared)
                forward = jax.jit(aj.moe_forward, static_argnames="kernels")
                expected = forward(p, xs[0], kernels=md.XLA_DECODE)
                for r in range(repeats):
                    for text, values in zip(arms, parsed, strict=True):
                        set_constants(code | values)
                        jax.clear_caches()
                        row = dict(shape=shape, format=fmt, tokens=tokens, arm=text or "code",
                                   round=r)
                        if r == 0:
                            err = md.rel_err(forward(p, xs[0], kernels=md.PALLAS), expected)
                            row.update(rel_err=err, ok="yes" if err < TOLERANCE else "NO")
                        busy, err = md._time(md.PALLAS, p, xs, loops, busy=True)
                        if busy:
                            row.update(busy_us=busy[0] * 1e6,
                                       busy_frac_hbm=nbytes / busy[0] / hbm)
                        with clock_samples() as clock:  # the step's calls: the SM clock
                            t, err = md._time(md.PALLAS, p, xs, loops)
                        row.update({k: clock[k] for k in ("sm_mhz_min", "power_w_max")
                                    if k in clock})
                        row["step_us"] = t * 1e6 if t is not None else err
                        if t is not None and t > 0:
                            row["frac_hbm"] = nbytes / t / hbm
                        rows.append(row)
                        print(table([row], COLUMNS), flush=True)
            del p
    finally:  # the code's values back
        set_constants(code)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny shape, interpret mode off GPU (a smoke test)")
    parser.add_argument("--shape", choices=list(md.ALL_SHAPES))
    parser.add_argument("--formats", nargs="+", choices=list(md.FORMATS))
    parser.add_argument("--tokens", nargs="+", type=int)
    parser.add_argument("--arms", nargs="+", default=None, metavar="ARM",
                        help="each 'NAME=VALUE ...' ('' for the code as it is)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the arms in turn")
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.tiny:
        sys.exit("benchmarks/moe_decode_arms.py needs a GPU (or --tiny for a CPU smoke test)")
    shape = args.shape or ("tiny" if args.tiny else "qwen3-30b-a3b")
    formats = args.formats or ["nvfp4"]
    tokens = args.tokens or ([2] if args.tiny else [8])
    arms = args.arms if args.arms is not None else ["", "FP4_PARTS=4"]
    try:
        for a in arms:
            parse_arm(a)
    except ValueError as err:
        parser.error(str(err))
    hbm = hbm_copy_bandwidth(0.0625 if args.tiny else 4.0)
    rows = run_arms(shape, formats, tokens, arms, repeats=args.repeats,
                    loops=1 if args.tiny else 8, hbm=hbm)
    device = jax.devices()[0]
    text = (f"## moe_decode arms ({device.device_kind}, jax {jax.__version__}"
            f"{', interpret mode' if not on_gpu else ''}), HBM copy {hbm / 1e12:.2f} TB/s\n\n"
            + table(rows, COLUMNS) + "\n")
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
