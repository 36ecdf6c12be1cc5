"""The enum base of the kernels' string-valued choices (formats, layouts, KV dtypes)."""

from __future__ import annotations

import enum


class CoercibleEnum(enum.Enum):
    """An enum whose ``coerce`` takes a member, its string value, or any enum with that value
    (e.g. ``atlas_jax``'s own ``Format``), and otherwise raises a ValueError naming ``_arg()``."""

    @classmethod
    def _arg(cls) -> str:
        """How errors name the value (the enum's name; a kernel argument's name where clearer)."""
        return cls.__name__

    @classmethod
    def coerce(cls, value):
        if isinstance(value, cls):
            return value
        raw = value.value if isinstance(value, enum.Enum) else value
        try:
            return cls(raw)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"{cls._arg()}: expected one of {allowed}, got {value!r}") from None
