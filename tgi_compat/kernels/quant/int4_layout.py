"""The int4 weight layout every int4 kernel reads: eight nibbles an int32 word, interleaved.

The layout is interleaved in periods of P input features (P = `int4_period(G)`, 128 for groups of 128): a
period is P/8 consecutive int32 words, and nibble i of its word j holds feature i * P/8 + j. So nibble i of a
run of words covers a contiguous run of features, and all eight nibbles of a word share one group: the few-row
GEMV (tgi_compat/kernels/gemv/) unpacks a word with one shift and one mask per nibble against contiguous
activations. `pack_int4` / `unpack_int4` convert from / to plain values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def int4_as_float(words, one_bits, NIBBLE: tl.constexpr):
    """Nibble NIBBLE of each int32 word as the float 1 + q/16, exactly and without a conversion instruction: the
    nibble is shifted to the mantissa's top bits (19..22) and 1.0's exponent (`one_bits`, 0x3F800000) is OR-ed
    in. `one_bits` comes in as a kernel argument so that the compiler cannot see it as a constant: the mask
    and the OR then become one three-input logic instruction (which takes one immediate) instead of two."""
    if 4 * NIBBLE <= 19:
        bits = words << (19 - 4 * NIBBLE)
    else:
        bits = words >> (4 * NIBBLE - 19)  # arithmetic on a negative word: the mask drops the sign bits
    return ((bits & 0x780000) | one_bits).to(tl.float32, bitcast=True)


def int4_period(group_size: int) -> int:
    """Input features per interleaving period of the int4 layout: the largest of 128 .. 8 dividing the group."""
    period = next((p for p in (128, 64, 32, 16, 8) if group_size % p == 0), 0)
    if not period:
        raise ValueError(f"int4 groups of {group_size} are not a multiple of 8")
    return period


def pack_int4(q: torch.Tensor, period: int) -> torch.Tensor:
    """[N, K] values 0..15 -> int32 [N, K/8] in the interleaved layout (K a multiple of period)."""
    n, k = q.shape
    nibbles = q.to(torch.int32).reshape(n, k // period, 8, period // 8)  # [N, periods, nibble, word]
    packed = torch.zeros(n, k // period, period // 8, dtype=torch.int32, device=q.device)
    for i in range(8):
        packed |= nibbles[:, :, i] << (4 * i)
    return packed.reshape(n, k // 8)


def unpack_int4(packed: torch.Tensor, period: int) -> torch.Tensor:
    """int32 [N, K/8] in the interleaved layout -> uint8 [N, K] values 0..15."""
    words = packed.reshape(packed.shape[0], -1, 1, period // 8)
    shifts = 4 * torch.arange(8, dtype=torch.int32, device=packed.device).view(1, 1, 8, 1)
    return ((words >> shifts) & 0xF).reshape(packed.shape[0], -1).to(torch.uint8)
