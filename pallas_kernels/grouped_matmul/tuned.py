"""Measured tile winners per device, stored in ``tuned.json`` beside this file by
``benchmarks/autotune_grouped_matmul.py``; used before the heuristic when an entry matches.

Key: device kind, then ``"{fmt}|{act_quant}|{fused}|n{N}|k{K}|rpg{rows per group, pow2}"``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

from pallas_kernels.grouped_matmul.config import ActivationQuant, TileConfig, WeightFormat

TUNED_PATH = Path(__file__).with_name("tuned.json")


def tuned_key(m: int, n: int, k: int, num_groups: int, fmt, *, fused_gate_up: bool,
              act_quant=ActivationQuant.NONE) -> str:
    rows = max(1, -(-m // max(num_groups, 1)))
    rpg = 1 << max(0, math.ceil(math.log2(rows)))
    return (f"{WeightFormat.coerce(fmt).value}|{ActivationQuant.coerce(act_quant).value}|"
            f"{'fused' if fused_gate_up else 'plain'}|n{n}|k{k}|rpg{rpg}")


@functools.cache
def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def tuned_tile_config(device_kind: str | None, key: str, path: Path = TUNED_PATH
                      ) -> TileConfig | None:
    """The stored winner for ``key`` on ``device_kind``, or None."""
    if device_kind is None:
        return None
    entry = _load(path).get(device_kind, {}).get(key)
    return TileConfig(**entry) if entry else None


def store(device_kind: str, winners: dict[str, TileConfig], path: Path = TUNED_PATH) -> None:
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.setdefault(device_kind, {}).update(
        {key: dataclasses.asdict(tile) for key, tile in sorted(winners.items())})
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    _load.cache_clear()
