"""Gemma's sandwich-norm kernels keep the unfused ops' roundings once compiled for the GPU.

Triton's interpreter rounds each op on its own, so the CPU tests cannot see what the NVPTX backend does: it
shrank the x-norm's rounded weight product and the residual add after it into one half-precision FMA, which
rounds once where the unfused ops round twice (on the H100 the residual sum of norm_add_rmsnorm and of the
GEMV's NORM_ADD_NORM prologue differed from the unfused ops' in about a third of its elements, by a bf16 ulp).
Here both kernels are compiled for sm_90 without a GPU (benchmarks/compile_only.py's compile-only
driver, in a process of its own: this one runs the interpreter) and their PTX must hold no such FMA."""

from __future__ import annotations

from benchmarks.compile_only import run_probe

PROBE = r"""
import json, re, torch
from benchmarks.compile_only import compiled_ptx, install_compile_only_driver
install_compile_only_driver()
from tgi_compat.kernels.elementwise import rmsnorm
from tgi_compat.kernels.gemv import dense
from tgi_compat.kernels.gemv.config import gemv_config
from tgi_compat.kernels.gemv.gemv import gemv
from tgi_compat.kernels.gemv.types import PROLOGUE_NORM_ADD_NORM
k, found = 3584, {}
for dtype in (torch.bfloat16, torch.float16):
    x, residual, w = torch.randn(1, k, dtype=dtype), torch.randn(1, k, dtype=dtype), torch.ones(k, dtype=dtype)
    weight, config = torch.randn(512, k, dtype=dtype), gemv_config(512, k, PROLOGUE_NORM_ADD_NORM)
    launches = {
        "norm_add_rmsnorm": (rmsnorm._norm_add_norm_kernel, lambda: rmsnorm.norm_add_rmsnorm(
            x, w, 1e-6, residual, w, 1e-6, residual_out=residual.clone())),
        "gemv NORM_ADD_NORM": (dense._gemv_kernel, lambda: gemv(
            x, weight, norm_weight=w, eps=1e-6, residual=residual, residual_out=residual.clone(), x_norm_weight=w,
            x_eps=1e-6, config=config)),
    }
    for name, (kernel_fn, launch) in launches.items():
        ptx = compiled_ptx(kernel_fn, launch)
        found[f"{name} {dtype}"] = dict(ptx_chars=len(ptx), half_fmas=len(re.findall(r"fma\.rn(\.ftz)?\.(bf16|f16)", ptx)))
print(json.dumps(found))
"""


def test_sandwich_norm_kernels_compile_without_half_precision_fmas():
    found = run_probe(PROBE)
    assert isinstance(found, dict)
    assert len(found) == 4 and all(kernel["ptx_chars"] > 0 for kernel in found.values()), found
    assert {name: kernel["half_fmas"] for name, kernel in found.items()} == dict.fromkeys(found, 0)
