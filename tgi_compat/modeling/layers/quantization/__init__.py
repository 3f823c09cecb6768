"""Weight quantization schemes behind one seam (base.LinearMethod), chosen once at startup.

`build_with(config)` is a construction-time scope, like `torch.device(...)`: every Linear built
inside it takes its method from `config`, so model files need no quantization argument. Nothing
reads it after the model is built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from tgi_compat.modeling.layers.quantization.base import LinearMethod, QuantizationConfig

_building_with: ContextVar[QuantizationConfig | None] = ContextVar("quantization_config", default=None)


@contextlib.contextmanager
def build_with(config: QuantizationConfig | None) -> Iterator[None]:
    token = _building_with.set(config)
    try:
        yield
    finally:
        _building_with.reset(token)


def method_for_new_linear() -> LinearMethod | None:
    """The active scheme's method for a Linear being constructed; None: unquantized."""
    config = _building_with.get()
    return None if config is None else config.linear_method()
