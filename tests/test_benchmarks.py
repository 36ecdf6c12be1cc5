"""The benchmark scripts' timing helpers, and their CPU smoke modes (tiny shapes, kernels in
interpret mode): a check that the scripts run, not a measurement."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import _common

ROOT = Path(__file__).resolve().parent.parent


def test_scan_program_runs_every_step_in_order():
    step = lambda c, x: {"y": x["a"] * c + x["b"]}  # noqa: E731
    xs = [{"a": jnp.full((3,), float(i)), "b": jnp.arange(3.0)} for i in range(4)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *xs)
    out = _common.scan_program(step)(jnp.float32(2.0), stacked)
    want = np.stack([2.0 * i + np.arange(3.0) for i in range(4)])
    np.testing.assert_allclose(out["y"], want)


def test_time_scan_is_the_marginal_time_of_a_step(monkeypatch):
    calls = []

    def fake_time_jax(fn, consts, stacked, **kw):  # a call: 300 us of its own + 2 us a step
        calls.append(stacked.shape[0])
        return 300e-6 + 2e-6 * stacked.shape[0]

    monkeypatch.setattr(_common, "time_jax", fake_time_jax)
    xs = [jnp.full((8,), float(i)) for i in range(3)]
    assert _common.time_scan(lambda c, x: x * c, 3.0, xs, loops=2) == pytest.approx(2e-6)
    assert calls == [24, 6]  # xs cycled 4 * loops and loops times


def test_time_scan_runs_and_rotating():
    xs = [jnp.full((8,), float(i)) for i in range(3)]
    t = _common.time_scan(lambda c, x: x * c, jnp.float32(3.0), xs, repeats=2, loops=2)
    assert np.isfinite(t) and abs(t) < 1.0  # a difference of two timings: noise may be < 0
    call = _common.rotating(lambda c, x: x + c, 1.0, xs)
    assert [float(call()[0]) for _ in range(4)] == [2.0, 3.0, 1.0, 2.0]


def test_device_kernels_sums_the_timeline_by_name_and_launch(monkeypatch):
    # two calls, each: kernel "a" twice (10 and 30 us), "b" once (5 us)
    call = [("a", 0.0, 10.0), ("b", 12.0, 17.0), ("a", 20.0, 50.0)]
    events = call + [(n, s + 100, e + 100) for n, s, e in call]
    monkeypatch.setattr(_common, "device_timeline", lambda fn, *a, calls: events)
    rows = _common.device_kernels(None, calls=2)
    assert rows == [("a", pytest.approx(40e-6), 2.0), ("b", pytest.approx(5e-6), 1.0)]
    rows = _common.device_kernels(None, calls=2, by_order=True)
    assert rows == [("#1 a", pytest.approx(30e-6), 1.0), ("#0 a", pytest.approx(10e-6), 1.0),
                    ("b", pytest.approx(5e-6), 1.0)]


def test_timeline_rows_split_busy_and_idle(monkeypatch):
    from benchmarks import moe_decode_hlo

    def fake_timeline(prog, consts, stacked, calls):  # a step: two kernels, 1 us idle, a copy
        steps = calls * stacked.shape[0]
        step = [("k1", 0.0, 4.0), ("k2", 5.0, 7.0), ("Memcpy DtoH", 7.0, 8.0)]
        return [(n, s + 10.0 * i, e + 10.0 * i) for i in range(steps) for n, s, e in step]

    monkeypatch.setattr(moe_decode_hlo, "device_timeline", fake_timeline)
    xs = [jnp.full((4,), float(i)) for i in range(2)]
    rows = moe_decode_hlo.timeline_rows(lambda c, x: x * c, jnp.float32(2.0), xs)
    assert [r["form"] for r in rows] == ["scan", "scan unroll 4", "straight-line"]
    for r in rows:  # idle: 1 us inside a step, 2 us between steps (all but the last)
        assert r["busy_us"] == pytest.approx(7.0) and r["launches"] == 3 and r["d2h"] == 1
        n = 3 * 4
        assert r["idle_us"] == pytest.approx((n * 1.0 + (n - 1) * 2.0) / n)
        assert r["most_idle_before"].startswith("k1 1.83, k2 1.00")


def test_device_busy_without_torch_is_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert _common.device_busy(lambda: jnp.ones(3)) is None


@pytest.mark.parametrize("args", [
    ["benchmarks/moe_decode.py", "--tiny", "--skip-check", "--shapes", "tiny", "--tokens", "1",
     "--formats", "nvfp4", "--step-repeats", "2"],
    ["benchmarks/paged_attention.py", "--smoke"],
], ids=["moe_decode", "paged_attention"])
def test_cpu_smoke_mode(args, tmp_path):
    out = tmp_path / "table.md"
    proc = subprocess.run([sys.executable, *args, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    timed = _column(text, "us")
    assert timed, text[-3000:]
    for cell in timed:  # our kernels' times: numbers, not an error written into the cell
        assert float(cell) > 0, text[-3000:]
    if "moe_decode" in args[0]:  # --step-repeats 2: the range of the two step timings
        for cell in _column(text, "us_range") or ["missing"]:
            low, high = map(float, cell.split("-"))
            assert 0 < low <= high, text[-3000:]
    if "moe_decode" in args[0]:  # the shared-expert A/B: both paths of the fold rule timed
        for name in ("step_folded_us", "step_own_path_us"):
            cells = _column(text, name)
            assert cells and all(float(c) > 0 for c in cells), text[-3000:]


def _column(text: str, name: str) -> list[str]:
    """Every cell of the column ``name`` over the markdown tables in ``text``."""
    cells, col = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            col = None
            continue
        row = [c.strip() for c in line.strip().strip("|").split("|")]
        if col is None:
            col = row.index(name) if name in row else -1
        elif col >= 0 and not set(line) <= set("|-: "):
            cells.append(row[col])
    return cells


@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_paged_combine_variants_match_combine_splits(q_len, with_sinks):
    """benchmarks/paged_combine.py's formulations equal ``combine_splits``, with empty splits
    (lse -inf) and a row no split saw (all -inf: 0 without sinks)."""
    from benchmarks import paged_combine as pc

    b, hk, s, g, d = 2, 3, 7, 4, 16
    ko, kl, ks = jax.random.split(jax.random.key(3), 3)
    o = jax.random.normal(ko, (b, hk, s, q_len * g, d), jnp.float32)
    lse = jax.random.normal(kl, (b, hk, s, q_len * g), jnp.float32) * 3
    lse = lse.at[:, :, -2:].set(-jnp.inf).at[0, 0, :, 0].set(-jnp.inf)
    sinks = jax.random.normal(ks, (hk * g,), jnp.float32) if with_sinks else None
    want = jax.jit(pc.VARIANTS["combine_splits"], static_argnames="q_len")(o, lse, sinks,
                                                                          q_len=q_len)
    assert want.shape == (b, q_len, hk * g, d)
    for name, fn in pc.VARIANTS.items():  # jitted: eager op-by-op dispatch took ~15 s
        got = jax.jit(fn, static_argnames="q_len")(o, lse, sinks, q_len=q_len)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_paged_attention_case_flag():
    import argparse

    from benchmarks import paged_attention as pa

    parser = argparse.ArgumentParser()
    assert pa._parse_case("1,32768,32,4,128,bf16", parser) == (1, 32768, 32, 4, 128, "bf16")
    for bad in ("1,2,3", "1,32768,32,4,128,int8", "1,32768,30,4,128,fp8", "a,b,c,d,e,fp8"):
        with pytest.raises(SystemExit):
            pa._parse_case(bad, parser)


def test_moe_decode_mosaic_k_splits_flag():
    """``--k-splits``: 'G,D' pairs or 'auto'; anything else is a usage error."""
    import argparse

    from benchmarks.moe_decode_mosaic import _splits

    assert _splits("2,3") == (2, 3)
    assert _splits("auto") == "auto"
    for bad in ("2", "a,b", "1,2,3"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected 'G,D'"):
            _splits(bad)


def test_moe_decode_mosaic_timeline_summary():
    """``--timeline``'s summary: two items of (2 gate_up, 1 h, 2 down) programs, each stamped
    with its phase and item; times from the first start in us (program 1's: program 0 starts
    half a us later, as other SMs' programs may on a GPU), across a wrap of the 32-bit clock."""
    from benchmarks.moe_decode_mosaic import timeline_summary

    base = (1 << 32) - 3000  # the clock wraps 3 us in
    us = [(0.5, 0.5, 5), (0, 0, 6), (1, 1, 7), (1, 1, 8),  # gate_up: item 0, then item 1
          (0, 6, 7), (0, 8, 9),  # h: waits for its item's gate_up
          (1, 7, 12), (2, 7, 13), (2, 9, 14), (3, 9, 15)]  # down
    tags = [(0, 0), (0, 0), (0, 1), (0, 1), (1, 0), (1, 1), (2, 0), (2, 0), (2, 1), (2, 1)]
    stamps = np.array([[(base + int(1000 * v)) % (1 << 32) for v in row] + [7, *tag]
                       for row, tag in zip(us, tags, strict=True)],
                      np.int64).astype(np.uint32).view(np.int32)
    text = timeline_summary(stamps)
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    cells = [ln.strip("| ").split(" | ") for ln in lines]
    assert cells[1] == ["gate_up", "4", "0", "1", "0", "6", "5", "8"]
    assert cells[2] == ["h", "2", "0", "0", "7", "1", "7", "9"]
    assert cells[3] == ["down", "4", "1", "3", "6", "5.5", "12", "15"]
    assert cells[5] == ["0", "6", "6", "7", "1", "7", "13"]  # item 0
    assert cells[6] == ["1", "8", "8", "9", "2", "9", "15"]


def test_moe_decode_plan_benchmark_checks_every_builder():
    """The plan benchmark (interpret mode) builds the same plan every way (it asserts so) and
    times each: 16 pairs (all four builders) and 136 (past the pairwise program)."""
    proc = subprocess.run([sys.executable, "benchmarks/moe_decode_plan.py", "--interpret",
                           "--tokens", "2", "17", "--experts", "16", "--loops", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plans = _column(proc.stdout, "plan")
    assert plans == ["xla", "xla-sort", "pairwise", "radix", "xla", "xla-sort", "radix"], plans
    # marginal step times (time_scan): a number each, its sign noise at tiny CPU steps
    assert all(np.isfinite(float(c)) for c in _column(proc.stdout, "scan_us")), \
        proc.stdout[-3000:]


def test_sass_loops_finds_backward_branches():
    """``mosaic_registers.sass_loops`` on nvdisasm-style text: the body of each backward
    branch, predicated opcodes counted by name, short spins and forward branches left out."""
    from benchmarks.mosaic_registers import sass_loops

    body = [f"        /*{16 * i:04x}*/                   {op} ;" for i, op in enumerate(
        ["HMUL2 R1, R2.H0_H0, R3", "LOP3.LUT R1, R1, 0xf, RZ, 0xc0, !PT", "HMUL2 R4, R5, R6",
         "@P0 BRA `(.L_x_9)", "@!P2 BRA `(.L_x_1)"])]
    sass = "\n".join(["        /*0000*/                   MOV R1, R2 ;", ".L_x_1:", *body,
                      ".L_x_9:", "        /*0100*/                   SYNCS.PHASECHK P2 ;",
                      "        /*0110*/              @!P2 BRA `(.L_x_9) ;", "        EXIT ;"])
    assert sass_loops(sass, min_length=3) == [
        (".L_x_1", 5, [("HMUL2", 2), ("BRA", 2), ("LOP3", 1)])]
    assert sass_loops(sass, min_length=2) == [
        (".L_x_1", 5, [("HMUL2", 2), ("BRA", 2), ("LOP3", 1)]),
        (".L_x_9", 2, [("SYNCS", 1), ("BRA", 1)])]



def test_mosaic_registers_reads_ptxas_reports():
    """``mosaic_registers._registers``: the count, its spill stores where there are any, or
    the last line of a failed compile; every case family names only cases it can build."""
    from benchmarks.mosaic_registers import _ARCHS, CASES, FAMILIES, PAGED_CASES, _registers

    report = ("ptxas info    : Function properties for k\n"
              "    {0} bytes stack frame, {0} bytes spill stores, {0} bytes spill loads\n"
              "ptxas info    : Used {1} registers, used 1 barriers")
    assert _registers(report.format(0, 72)) == "72"
    assert _registers(report.format(572, 255)) == "255 (spills 572 B)"
    assert _registers("Traceback\nValueError: Mosaic GPU kernel exceeds available shared "
                      "memory") == ("error: ValueError: Mosaic GPU kernel exceeds available "
                                    "shared memory")
    assert _registers("") == "error: no output"
    assert len(CASES) == 3 * len(_ARCHS) and FAMILIES["grouped-matmul"][0] is _ARCHS
    assert all(q * g <= 64 for q, g in PAGED_CASES.values())


def test_triton_offline_lowers_every_case():
    """``triton_offline.lower_all`` (in its own process: it patches jax's lowering): each case
    of a model's MoE layer and attention lowers for an abstract GB10 and hands over its Triton
    kernels' TTIR with warps and stages (the compile step needs the triton package: not here)."""
    code = ("import pickle, sys; from benchmarks.triton_offline import lower_all; "
            "sys.stdout.buffer.write(pickle.dumps(lower_all('gb10', ['moe', 'attention'], "
            "['gpt_oss'])))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = pickle.loads(proc.stdout)
    assert len(cases) == 4 * 4 + 3 * 3  # formats x paths; KV dtypes x (decode 1 / 4, prefill)
    for case, kernels in cases:
        assert not isinstance(kernels, str), (case, kernels)
        assert kernels, case
        for text, warps, stages in kernels:
            assert '"tt.func"' in text and warps in (1, 2, 4, 8) and stages >= 1, case


def test_arms_benchmark_times_each_arm_in_turn():
    """The A/B script (interpret mode off GPU): a row a (round, arm) in turn, each a step
    time, the first round's outputs checked against the XLA decode path, the code's constants
    back afterwards."""
    proc = subprocess.run([sys.executable, "benchmarks/moe_decode_arms.py", "--tiny", "--arms",
                           "", "FP4_PARTS=4 routing.ROUTER_REDUCE_MAX_PRODUCTS=0",
                           "--repeats", "2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = proc.stdout[proc.stdout.index("## moe_decode arms"):]
    arms = _column(final, "arm")
    assert arms == ["code", "FP4_PARTS=4 routing.ROUTER_REDUCE_MAX_PRODUCTS=0"] * 2, final
    assert all(np.isfinite(float(c)) for c in _column(final, "step_us")), final
    assert _column(final, "ok") == ["yes", "yes", "", ""], final
    assert all(float(c) < 1e-2 for c in _column(final, "rel_err")[:2]), final


def test_clock_samples(monkeypatch):
    """``nvidia-smi``'s clock and power lines -> their lowest clock, median clock, highest
    power; lines that do not parse are skipped; without ``nvidia-smi`` the block runs and the
    result stays empty."""
    from benchmarks import _common

    text = "1980, 127.5\n1890, 499.3\n[N/A], [N/A]\n1965, 450.0\n"
    assert _common.parse_clock_samples(text) == dict(sm_mhz_min=1890.0, sm_mhz_median=1965.0,
                                                     power_w_max=499.3)
    assert _common.parse_clock_samples("") == {}
    monkeypatch.setattr(_common.shutil, "which", lambda name: None)
    ran = []
    with _common.clock_samples() as clock:
        ran.append(1)
    assert ran and clock == {}


def test_arms_are_checked():
    from benchmarks.moe_decode_arms import parse_arm
    from pallas_kernels.moe_decode import mosaic

    assert parse_arm("") == {}
    assert parse_arm("FP4_PARTS=4 routing.ROUTER_REDUCE_MAX_PRODUCTS=0 FUSE_MLP_TOKENS=(1,32)") \
        == {("mosaic", "FP4_PARTS"): 4, ("routing", "ROUTER_REDUCE_MAX_PRODUCTS"): 0,
            ("mosaic", "FUSE_MLP_TOKENS"): (1, 32)}
    assert parse_arm("rows.PLAN_X_ROWS_MAX_PAIRS=128") == {("rows", "PLAN_X_ROWS_MAX_PAIRS"): 128}
    for bad, match in [("NO_SUCH=1", "has no constant"), ("FP4_PARTS", "expected NAME=VALUE"),
                       ("FP4_PARTS=four", "not a Python literal"),
                       ("other.X=1", "expected NAME=VALUE"), ("window=1", "has no constant")]:
        with pytest.raises(ValueError, match=match):
            parse_arm(bad)
    assert mosaic.FP4_PARTS == 2
    for cmd in (["benchmarks/moe_decode_arms.py", "--tiny", "--arms", "NO_SUCH=1"],
                ["benchmarks/moe_decode_hlo.py", "--set", "NO_SUCH=1"],
                ["benchmarks/moe_decode_mosaic.py", "--timeline", "--set", "NO_SUCH=1"]):
        proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 2 and "has no constant NO_SUCH" in proc.stderr, proc.stderr


def test_set_constants_sets_them(monkeypatch):
    """``--set`` of the one-off tools: one arm's constants, set (here undone by monkeypatch)."""
    from benchmarks.moe_decode_arms import arm_argument, set_constants
    from pallas_kernels.moe_decode import mosaic, rows

    monkeypatch.setattr(mosaic, "FP4_PARTS", mosaic.FP4_PARTS)
    monkeypatch.setattr(rows, "PLAN_X_ROWS_MAX_PAIRS", rows.PLAN_X_ROWS_MAX_PAIRS)
    set_constants(arm_argument("FP4_PARTS=4 rows.PLAN_X_ROWS_MAX_PAIRS=7"))
    assert mosaic.FP4_PARTS == 4 and rows.PLAN_X_ROWS_MAX_PAIRS == 7
    set_constants(arm_argument(""))
    assert mosaic.FP4_PARTS == 4


def test_router_benchmark_checks_both_routers():
    """The router benchmark (interpret mode off GPU) routes the same way with both routers (it
    asserts so) and times each."""
    proc = subprocess.run([sys.executable, "benchmarks/moe_router.py", "--shapes", "tiny-gpt-oss",
                           "--tokens", "3", "--loops", "1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _column(proc.stdout, "router") == ["xla", "pallas"], proc.stdout[-3000:]
    # marginal step times (time_scan): a number each, its sign noise at tiny CPU steps
    assert all(np.isfinite(float(c)) for c in _column(proc.stdout, "scan_us")), \
        proc.stdout[-3000:]


def test_every_bench_name_has_its_script():
    from atlas_jax import cli

    for name, script in cli.BENCHMARKS.items():
        assert (ROOT / "benchmarks" / script).is_file(), name
