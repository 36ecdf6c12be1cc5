"""Helpers shared by the scripts that write transformers-made fixtures: the golden scripts next
to this file and ``checkpoints/make_checkpoint.py``.

Runs in the side virtual environment of those scripts (torch + transformers). The golden scripts
import it as ``_hf`` (their own folder is on ``sys.path`` when run as scripts);
``make_checkpoint.py`` puts this folder on ``sys.path`` first.
"""

from __future__ import annotations

import argparse
import math
import shutil
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

# Eager attention and eager experts: the plain PyTorch code paths the goldens are made with.
EAGER = {"attn_implementation": "eager", "experts_implementation": "eager"}
CHECKPOINT_FILES = ("config.json", "model.safetensors")

# ----------------------------------------------------------------------------- random models


def name_seed(name: str, salt: int = 0) -> int:
    """A fixture's seed: crc32 of its name (+ salt, bumped to re-draw), as a positive int32."""
    return (zlib.crc32(name.encode()) + salt) & 0x7FFFFFFF


def seeded(seed: int) -> torch.Generator:
    """Seed torch's global generator and return a fresh generator with the same seed."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    return gen


def randomize_tensor_(
    name: str, t: torch.Tensor, gen: torch.Generator, *, zero_std: float = 0.1,
    fan_in: int | None = None,
) -> None:
    """Overwrite one parameter with a non-trivial random value (call under ``torch.no_grad``).

    Vectors that HF initialises to one (norm weights, scales) get 1 + N(0, 0.25^2), other vectors
    (biases, zero-centred norm weights) N(0, zero_std^2). Matrices get N(0, 1/fan_in) so that
    activations stay O(1): ``fan_in`` defaults to the last dim, and is 1 for embeddings.
    """
    if t.ndim == 1:
        if bool((t == 1).all()):
            t.copy_(1.0 + 0.25 * torch.randn(t.shape, generator=gen))
        else:
            t.copy_(zero_std * torch.randn(t.shape, generator=gen))
        return
    if "embed" in name:
        fan_in = 1
    elif fan_in is None:
        fan_in = t.shape[-1]
    t.copy_(torch.randn(t.shape, generator=gen) / math.sqrt(fan_in))


# ----------------------------------------------------------------------------- files


def remove_dir(path: Path) -> None:
    """Delete ``path`` (a folder written by an earlier run) if it exists."""
    if path.exists():
        shutil.rmtree(path)


def save_checkpoint(model, path: Path) -> None:
    """``save_pretrained`` (safetensors), keeping only ``config.json`` + ``model.safetensors``
    (mode 0644)."""
    model.save_pretrained(path, safe_serialization=True)
    for f in path.iterdir():
        if f.name not in CHECKPOINT_FILES:
            f.unlink()
        else:
            f.chmod(0o644)


def load_float32(cls, path: Path, **kwargs):
    """``cls.from_pretrained(path)`` in float32 with eager attention and experts, in eval mode."""
    return cls.from_pretrained(path, **EAGER, dtype=torch.float32, **kwargs).eval()


def save_and_reload(model, path: Path):
    """Write ``model`` to a fresh ``path`` (``save_checkpoint``) and load it back: goldens
    computed with the reloaded model come from exactly the files on disk."""
    remove_dir(path)
    save_checkpoint(model, path)
    return load_float32(type(model), path)


def to_numpy(out: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Golden arrays: integer tensors as int32, everything else as float32."""
    arrays = {}
    for k, v in out.items():
        a = v.detach().cpu().numpy()
        arrays[k] = a.astype(np.int32) if a.dtype.kind in "iu" else a.astype(np.float32)
    return arrays


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    np.savez(path, **arrays)
    path.chmod(0o644)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


# ----------------------------------------------------------------------------- README


def readme_head(title: str, *command: str) -> list[str]:
    """A fixtures README's first lines: the title and the versions + command that made it."""
    return [
        f"# {title}",
        "",
        f"Made with transformers {transformers.__version__}, torch {torch.__version__}, by",
        "",
        *(f"    {line}" for line in command),
        "",
    ]


def table_head(*columns: str) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]


# ----------------------------------------------------------------------------- command line


def fixture_parser(doc: str, default_out: Path) -> argparse.ArgumentParser:
    """The golden scripts' parser: the docstring's first line and ``--out``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out)
    return parser


def add_only(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", nargs="*", help="fixture names to (re)make")


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``, create ``--out`` and run torch on one thread."""
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    return args


def selected(fixtures: Iterable[Any], only: Sequence[str] | None) -> list[Any]:
    """The fixtures ``--only`` names (all of them without ``--only``)."""
    return [fx for fx in fixtures if not only or fx.name in only]
