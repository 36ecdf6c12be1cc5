"""What the kernels' heuristics ask of the device (None where it is not a GPU)."""

from __future__ import annotations

import contextlib

import jax


def device_sm_count() -> int | None:
    """Multiprocessor count of the default device, or None when it is not a GPU."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return None
    count = getattr(dev, "core_count", None)
    return int(count) if count else None


def device_kind() -> str | None:
    """``device_kind`` of the default device (e.g. 'NVIDIA H200'), or None when not a GPU."""
    dev = jax.devices()[0]
    return dev.device_kind if dev.platform == "gpu" else None


def device_compute_capability() -> tuple[int, int] | None:
    """CUDA compute capability of the default device (e.g. (9, 0) on Hopper), or None when it
    is not a CUDA GPU."""
    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", None) if dev.platform == "gpu" else None
    if not cc:
        return None
    major, minor = str(cc).split(".")[:2]
    return int(major), int(minor)


@contextlib.contextmanager
def abstract_gpu(kind: str = "NVIDIA H200", sms: int = 132):
    """Lowering for a GPU this machine lacks: inside, the kernels' heuristics see an abstract
    device of this kind and SM count (``jit(f).trace(...).lower(lowering_platforms=("cuda",))``
    in the tests and the offline benchmark tools)."""
    from jax._src import mesh as mesh_lib

    dev = mesh_lib.AbstractDevice(device_kind=kind, num_cores=sms, platform="gpu")
    with jax.sharding.use_abstract_mesh(mesh_lib.AbstractMesh((1,), ("x",),
                                                              abstract_device=dev)):
        yield
