"""The benchmark scripts' timing helpers, and their CPU smoke modes (tiny shapes, kernels in
interpret mode): a check that the scripts run, not a measurement."""

from __future__ import annotations

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


def test_time_scan_and_rotating():
    xs = [jnp.full((8,), float(i)) for i in range(3)]
    t = _common.time_scan(lambda c, x: x * c, jnp.float32(3.0), xs, repeats=2, loops=2)
    assert 0 < t < 1.0
    call = _common.rotating(lambda c, x: x + c, 1.0, xs)
    assert [float(call()[0]) for _ in range(4)] == [2.0, 3.0, 1.0, 2.0]


def test_device_busy_without_torch_is_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert _common.device_busy(lambda: jnp.ones(3)) is None


@pytest.mark.parametrize("args", [
    ["benchmarks/moe_decode.py", "--tiny", "--skip-check", "--shapes", "tiny", "--tokens", "1",
     "--formats", "nvfp4"],
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
