"""Test-session setup: 8 fake CPU devices for the expert-parallel tests (tests/test_parallel.py).

XLA reads ``XLA_FLAGS`` when the CPU backend is first created, so the flag must be set before any
test creates an array; this conftest is imported before every test module. The library itself
never sets it. Existing flags are kept; an explicit device count from the environment wins.
"""

import os

_FLAG = "--xla_force_host_platform_device_count"
_flags = os.environ.get("XLA_FLAGS", "")
if _FLAG not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} {_FLAG}=8".strip()
