"""Tuned-config lookups for projections widened by LoRA: a folded projection (tgi_compat/modeling/lora/folding.py)
stacks every slot's A under its weight, 8 slots of r = 16 adding 6% to Llama-3-8B's q|k|v and 3% to o. Where measured
faster (the 1-byte GEMV: tgi_compat/kernels/gemv/config.py; the FP8 GEMM: tgi_compat/kernels/quant/fp8_gemm.py), such a
shape keeps its base shape's config (the same K, a few more output rows) rather than a rule of thumb's."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TypeVar

WIDENING = 1.125  # the most a tuned N may be widened and keep its config

Value = TypeVar("Value")


def tuned_for(table: Mapping[tuple, Value], key: tuple[Hashable, ...], n_index: int) -> tuple[bool, Value | None]:
    """(found, config) of `key` in `table`: its own entry, else that of the widest tuned N (at key[n_index]) that
    key's N widens by at most WIDENING with every other field equal."""
    if key in table:
        return True, table[key]
    n = key[n_index]
    assert isinstance(n, int)
    rest = key[:n_index] + key[n_index + 1 :]
    widened = [
        tuned
        for tuned in table
        if tuned[:n_index] + tuned[n_index + 1 :] == rest and tuned[n_index] < n <= tuned[n_index] * WIDENING
    ]
    if not widened:
        return False, None
    return True, table[max(widened, key=lambda tuned: tuned[n_index])]
