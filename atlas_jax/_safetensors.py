"""A small lazy safetensors reader: headers parsed once, each tensor read on demand.

safetensors' own numpy reader cannot return F8_E4M3 / F8_E8M0 tensors; this one maps every
safetensors dtype onto numpy / ml_dtypes and reads only the bytes of the requested tensor. Only
the safetensors format is read: no pickle, no code from the checkpoint.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "U16": np.uint16,
    "U32": np.uint32,
    "U64": np.uint64,
    "BOOL": np.bool_,
}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupt, or lacks a tensor."""


class SafetensorsFile:
    """One .safetensors file: its header, and tensors read on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                raw = f.read(8)
                if len(raw) < 8:
                    raise CheckpointError(f"{self.path}: truncated (no safetensors header)")
                (n,) = struct.unpack("<Q", raw)
                if n > min(_MAX_HEADER, size - 8):
                    raise CheckpointError(
                        f"{self.path}: corrupt or truncated safetensors header (length {n}, "
                        f"file size {size})")
                header = json.loads(f.read(n))
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
        header.pop("__metadata__", None)
        self.data_start = 8 + n
        self.entries = header
        end = max((e["data_offsets"][1] for e in header.values()), default=0)
        if self.data_start + end > size:
            raise CheckpointError(f"{self.path}: truncated: the header needs "
                                  f"{self.data_start + end} bytes, the file has {size}")
        self.reads = 0  # tensors read so far (tests count them)

    def names(self) -> Iterable[str]:
        return self.entries.keys()

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        e = self.entries[name]
        return e["dtype"], tuple(e["shape"])

    def get(self, name: str) -> np.ndarray:
        if name not in self.entries:
            raise CheckpointError(f"tensor {name!r} not found in {self.path}")
        e = self.entries[name]
        if e["dtype"] not in DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype "
                                  f"{e['dtype']}")
        dtype = np.dtype(DTYPES[e["dtype"]])
        start, stop = e["data_offsets"]
        shape = tuple(e["shape"])
        if stop - start != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise CheckpointError(f"{self.path}: tensor {name!r} header is corrupt "
                                  f"({stop - start} bytes for {e['dtype']} {list(shape)})")
        with open(self.path, "rb") as f:
            f.seek(self.data_start + start)
            buf = f.read(stop - start)
        if len(buf) != stop - start:
            raise CheckpointError(f"{self.path}: truncated while reading {name!r}")
        self.reads += 1
        return np.frombuffer(buf, dtype=dtype).reshape(shape)


def save_file(tensors: dict[str, np.ndarray], path: str | os.PathLike,
              metadata: dict[str, str] | None = None) -> None:
    """Write a .safetensors file (any dtype in DTYPES, F8 included)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    arrays = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in NAMES:
            raise TypeError(f"save_file: tensor {name!r} has unsupported dtype {a.dtype}")
        header[name] = {"dtype": NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
