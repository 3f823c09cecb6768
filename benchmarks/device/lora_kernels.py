"""The LoRA kernels of one decode step (benchmarks/device/lora.py's part 1, and the GPU tests' cases): every layer's
q|k|v, o, gate|up and down of a Llama-shaped model (r = 16, --max-loras 8), each layer on its own slot buffers as
in a real step, timed from CUDA-graph replays (benchmarks/device/timing.py): the shrink then the expand at every
row count.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import partial

import torch

from benchmarks.device.peft_adapters import projection_shapes
from tgi_compat.modeling.lora.step import LoraStep, lora_step

RANK, ADAPTERS = 16, 8


def log(message: str) -> None:
    print(f"[bench_lora {time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass(frozen=True)
class LoraCase:
    """One projection's LoRA work in a step, laid out as tgi_compat/modeling/lora/weights.py lays it out."""

    x: torch.Tensor  # [T, K] the projection's input
    a: torch.Tensor  # [L, S * R, K]
    b: torch.Tensor  # [L, OUT, R]
    out: torch.Tensor  # [T, OUT] the base projection's output, added into
    step: LoraStep
    slice_ends: tuple[int, ...]


class Kernels(Enum):
    TWO = "shrink+expand"  # two launches
    REFERENCE = "reference"  # the torch definition


def fused_projections(config: dict) -> dict[str, tuple[int, tuple[int, ...]]]:
    """q|k|v, o, gate|up, down: (in features, each slice's out features)."""
    shapes = projection_shapes(config)
    return {
        "qkv": (shapes["q_proj"][0], (shapes["q_proj"][1], shapes["k_proj"][1], shapes["v_proj"][1])),
        "o": (shapes["o_proj"][0], (shapes["o_proj"][1],)),
        "gate_up": (shapes["gate_proj"][0], (shapes["gate_proj"][1], shapes["up_proj"][1])),
        "down": (shapes["down_proj"][0], (shapes["down_proj"][1],)),
    }


def row_slots(rows: int, max_loras: int, base_every: int = 0) -> torch.Tensor:
    """Row i on slot i % max_loras (the adapters spread evenly); with base_every > 0 every such row is a base row."""
    slots = torch.arange(rows) % max_loras
    if base_every:
        slots[::base_every] = -1
    return slots


def slice_ends(slice_outs: tuple[int, ...]) -> tuple[int, ...]:
    """Each slice's last output column + 1 (the expands' column split)."""
    return tuple(itertools.accumulate(slice_outs))


def lora_case(
    size_in: int, slice_outs: tuple[int, ...], slots: torch.Tensor, max_loras: int, rank: int, dtype: torch.dtype
) -> LoraCase:
    """Random inputs and slot buffers (made on the current default device)."""
    rows, out_total = slots.shape[0], sum(slice_outs)
    ends = slice_ends(slice_outs)
    x = torch.randn(rows, size_in, dtype=dtype)
    a = (torch.randn(max_loras, len(slice_outs) * rank, size_in) / size_in**0.5).to(dtype)
    b = (torch.randn(max_loras, out_total, rank) / rank**0.5).to(dtype)
    out = torch.randn(rows, out_total, dtype=dtype)
    return LoraCase(x, a, b, out, lora_step(slots.to(x.device), max_loras), ends)


@dataclass(frozen=True)
class Tiling:
    """The kernels' tunables (None / 0: their defaults)."""

    split_k: int | None = None  # the shrink's splits of K
    block_n: int = 0  # the expand's output columns per program


def lora_call(case: LoraCase, kernels: Kernels = Kernels.TWO, tiling: Tiling = Tiling()) -> Callable[[], None]:
    """The projection's LoRA delta added into case.out, by the kernels named."""
    from tgi_compat.kernels.lora.expand import EXPAND_BLOCK_N, lora_expand, lora_expand_ref
    from tgi_compat.kernels.lora.shrink import NO_PROLOGUE, lora_shrink, lora_shrink_ref

    step, ends = case.step, case.slice_ends
    if kernels is Kernels.REFERENCE:
        return lambda: lora_expand_ref(case.out, lora_shrink_ref(case.x, case.a, step), case.b, step, ends)
    split_k, block_n = tiling.split_k, tiling.block_n or EXPAND_BLOCK_N
    return lambda: lora_expand(
        case.out, lora_shrink(case.x, case.a, step, NO_PROLOGUE, split_k), case.b, step, ends, block_n
    )


SWEEP = [Tiling(split_k, block_n) for split_k in (None, 4, 8) for block_n in (64, 128, 256)]


FOLDED_SWEEP = [(block_n, warps) for block_n in (64, 128, 256, 512) for warps in (2, 4, 8)]


def folded_expand_times(config: dict, kernel_rows: tuple[int, ...], device: str) -> list[dict]:
    """us per decode step of every layer's folded expand (tgi_compat.kernels.lora.expand_folded), bf16, rows spread
    over the slots, at each (block_n, num_warps) of FOLDED_SWEEP; on the CPU each tiling once against the reference
    (times 0)."""
    from benchmarks.device.timing import replay_us
    from tgi_compat.kernels.lora.expand_folded import lora_expand_folded, lora_expand_folded_ref

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    results = []
    for rows in kernel_rows:
        step = lora_step(row_slots(rows, ADAPTERS).to(device), ADAPTERS)
        with torch.device(device):
            layers = []
            for _ in range(config["num_hidden_layers"]):
                layer = {}
                for name, (_, outs) in fused_projections(config).items():
                    ends = slice_ends(outs)
                    full = torch.randn(rows, ends[-1] + ADAPTERS * len(ends) * RANK, dtype=dtype)
                    layer[name] = (full, (torch.randn(ADAPTERS, ends[-1], RANK) / RANK).to(dtype), ends)
                layers.append(layer)
        result: dict = dict(rows=rows, sweep_us={})
        for block_n, warps in FOLDED_SWEEP:
            calls = [
                partial(lora_expand_folded, full, step, b, ends, block_n, num_warps=warps)
                for layer in layers
                for full, b, ends in layer.values()
            ]
            if device == "cpu":
                full, b, ends = layers[0]["qkv"]
                expected = lora_expand_folded_ref(full, step, b, ends)
                torch.testing.assert_close(calls[0](), expected, rtol=1e-4, atol=1e-4)
                result["sweep_us"][f"block_n={block_n},warps={warps}"] = 0.0
                continue
            result["sweep_us"][f"block_n={block_n},warps={warps}"] = replay_us(calls) * len(calls)
        log(f"folded expand: {result}")
        results.append(result)
        del layers
    return results


def kernel_times(
    config: dict, kernel_rows: tuple[int, ...], dtype: torch.dtype, device: str, sweep: list[Tiling] | None = None
) -> list[dict]:
    """us per decode step of every layer's LoRA (`step_us`: shrink + expand) and per layer of each projection's
    (`qkv_us`, ...); with `sweep`, `sweep_us` too: the step at each tiling. On the CPU (a smoke run) each kernel
    runs once, against the reference (every tiling of the sweep), and the times are 0."""
    from benchmarks.device.timing import replay_us

    results = []
    for rows in kernel_rows:
        slots = row_slots(rows, ADAPTERS)
        with torch.device(device):
            projections = fused_projections(config).items()
            layers = [
                {name: lora_case(k, outs, slots, ADAPTERS, RANK, dtype) for name, (k, outs) in projections}
                for _ in range(config["num_hidden_layers"])
            ]
        result: dict = dict(rows=rows)
        if device == "cpu":
            for case in layers[0].values():
                for tiling in sweep or [Tiling()]:
                    expected = case.out.clone()
                    lora_call(case, Kernels.TWO, tiling)()
                    reference = LoraCase(case.x, case.a, case.b, expected, case.step, case.slice_ends)
                    lora_call(reference, Kernels.REFERENCE)()
                    torch.testing.assert_close(case.out, expected, rtol=1e-4, atol=1e-4)
            result["step_us"] = 0.0
        else:
            calls = [lora_call(case) for layer in layers for case in layer.values()]
            result["step_us"] = replay_us(calls) * len(calls)
            for name in fused_projections(config):
                result[f"{name}_us"] = replay_us([lora_call(layer[name]) for layer in layers])
            for tiling in sweep or []:
                calls = [lora_call(case, Kernels.TWO, tiling) for layer in layers for case in layer.values()]
                name = f"split_k={tiling.split_k or 'auto'},block_n={tiling.block_n}"
                result.setdefault("sweep_us", {})[name] = replay_us(calls) * len(calls)
        log(f"kernels: {result}")
        results.append(result)
        del layers
    return results
