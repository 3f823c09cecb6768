"""The LoRA kernels compile for sm_90 in every variant serving launches (bf16; the shrink with and without its K
split and with each prologue, none of them with atomics, the expand for 1, 2 and 3 slices, the expand of a
folded projection; the decode-sized ones as programmatic dependents), without a GPU (benchmarks/compile_only.py, in
a process of its own): the interpreter runs them on the CPU, the GPU tests (tests/gpu/test_lora_gpu.py) on the
device."""

from __future__ import annotations

from benchmarks.compile_only import run_probe

PROBE = r"""
import json, re, torch
from benchmarks.compile_only import compiled_ptx, install_compile_only_driver
install_compile_only_driver()
from tgi_compat.kernels.lora import expand as ex, shrink as sh
from tgi_compat.modeling.lora.step import lora_step

found = {}
for rows, k, prologue in ((64, 4096, "norm"), (1, 14336, "silu_mul"), (1000, 4096, "")):
    step = lora_step(torch.arange(rows) % 8, 8)
    x = torch.zeros(rows, 2 * k if prologue == "silu_mul" else k, dtype=torch.bfloat16)
    a = torch.zeros(8, 48, k, dtype=torch.bfloat16)
    pro = sh.ShrinkPrologue(torch.ones(k, dtype=torch.bfloat16), 1e-5) if prologue == "norm" else sh.ShrinkPrologue(silu_mul=prologue == "silu_mul")
    ptx = compiled_ptx(sh._lora_shrink_kernel, lambda: sh.lora_shrink(x, a, step, pro, pdl=rows < 1000))
    found[f"shrink {rows}x{k}"] = dict(split_k=sh.shrink_split_k(rows, k), ptx=len(ptx) > 0, atomics=bool(re.search(r"\b(atom|red)\.global", ptx)), pdl="griddepcontrol.wait" in ptx)
for ends in ((4096,), (14336, 28672), (4096, 5120, 6144)):
    step = lora_step(torch.arange(64) % 8, 8)
    out = torch.zeros(64, ends[-1], dtype=torch.bfloat16)
    shrunk = sh.Shrunk(torch.zeros(16, 64, 16 * len(ends)), torch.zeros(16, 64), 4096, 1e-5)
    b = torch.zeros(8, ends[-1], 16, dtype=torch.bfloat16)
    ptx = compiled_ptx(ex._lora_expand_kernel, lambda: ex.lora_expand(out, shrunk, b, step, ends, pdl=True))
    found[f"expand {len(ends)} slices"] = dict(ptx=len(ptx) > 0, pdl="griddepcontrol.wait" in ptx)
from tgi_compat.kernels.lora import expand_folded as er
for rows, ends in ((1, (4096, 5120, 6144)), (64, (14336, 28672)), (256, (4096,))):
    full = torch.zeros(rows, ends[-1] + 8 * 16 * len(ends), dtype=torch.bfloat16)
    b = torch.zeros(8, ends[-1], 16, dtype=torch.bfloat16)
    step = lora_step(torch.arange(rows) % 9 - 1, 8)
    ptx = compiled_ptx(er._lora_expand_folded_kernel, lambda: er.lora_expand_folded(full, step, b, ends, pdl=True))
    found[f"expand rows {rows}x{len(ends)}"] = dict(ptx=len(ptx) > 0, pdl="griddepcontrol.wait" in ptx)
print(json.dumps(found))
"""


def test_lora_kernels_compile_for_sm90():
    found = run_probe(PROBE)
    assert isinstance(found, dict)
    assert all(kernel["ptx"] for kernel in found.values()), found
    assert found["shrink 64x4096"]["split_k"] == 16 and found["shrink 1x14336"]["split_k"] == 32, found
    assert found["shrink 1000x4096"]["split_k"] == 1, found
    assert not any(kernel.get("atomics") for kernel in found.values()), found  # splits write their own sums
    # the decode-sized launches wait on the kernel before them under programmatic dependent launch
    assert all(kernel["pdl"] for name, kernel in found.items() if name != "shrink 1000x4096"), found
    assert not found["shrink 1000x4096"]["pdl"], found
    assert len(found) == 9
