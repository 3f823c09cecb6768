"""Registers, spills and load widths of the few-row GEMV for sm_90, compiled on a machine with no GPU.

    python -m benchmarks.gemv_resources [--format int4|fp8] N,K,PROLOGUE,ROWS[,block_n,block_k,warps,stages,split_k] ...

PROLOGUE: 0 plain, 1 RMSNorm + residual, 2 SiLU-mul. Without the config fields the default config runs
(tgi_compat.kernels.gemv.config.gemv_config). --one-row makes a given config run the one-row int4 kernel (tgi_compat/kernels/gemv_int4_one_row.py)
instead of the tile kernel; --sass counts the kernel's SASS opcodes (GEMV_SASS_OUT=FILE also writes its SASS and
TTGIR). Triton's NVIDIA backend builds the launch down to a cubin through benchmarks.compile_only's
driver; cuobjdump (shipped with Triton) reads its resource usage.

The compiler is the installed Triton's, and the device runs Triton 3.6 (torch 2.11), whose layouts can differ from
a newer one's: compile with it (`pip install --target DIR triton==3.6.0`, then PYTHONPATH=DIR). That is how the
one-row int4 kernel's 2-D weight loads were found (a 3-D load spilled under 3.6 and not under 3.9), and how the
tile kernel's defaults were chosen (a thread holding 32 words spilled; x needs no shared-memory conversion where
its layout is the weight tile's).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import re
import subprocess
import tempfile
from pathlib import Path

from benchmarks.compile_only import compiled_kernels, install_compile_only_driver


def compile_case(spec: str, fmt: str, one_row: bool):
    """The compiled kernel of one `N,K,PROLOGUE,ROWS[,config]` case."""
    import torch

    from tgi_compat.kernels import gemv, gemv_int4_one_row

    n, k, prologue, rows, *fields = (int(v) for v in spec.split(","))
    config = None
    if fields:
        block_n, block_k, warps, stages, *split = fields
        split_k = split[0] if split else 1
        config = gemv.GemvConfig(block_n, block_k, warps, stages, split_k=split_k, one_row=one_row)
    if fmt == "int4" and config is None:
        config = gemv.int4_config(k, rows, 128, n, prologue)
        if config.separate_prologue and prologue:  # its first launch would be the norm's
            print(f"{spec}: the default config runs its prologue as its own kernel; the GEMV compiled without it")
            config, prologue = dataclasses.replace(config, separate_prologue=False), 0
    x = torch.randn(rows, 2 * k if prologue == 2 else k, dtype=torch.bfloat16)
    kwargs: dict = {"silu_mul": True} if prologue == 2 else {}
    if prologue == 1:
        zeros = torch.zeros(rows, k, dtype=torch.bfloat16)
        kwargs = dict(norm_weight=torch.ones(k, dtype=torch.bfloat16), eps=1e-5, residual=zeros)
        kwargs["residual_out"] = zeros.clone()
    if fmt == "int4":
        groups = torch.ones(n, k // 128, dtype=torch.bfloat16)
        weight = gemv.QuantizedWeight(torch.zeros(n, k // 8, dtype=torch.int32), groups, groups.clone(), 128)
        kernel_fn = gemv_int4_one_row._gemv_int4_one_row_kernel if config.one_row else gemv._gemv_int4_kernel
    else:
        weight = gemv.QuantizedWeight(torch.zeros(n, k, dtype=torch.uint8).view(torch.float8_e4m3fn), torch.ones(n))
        kernel_fn = gemv._gemv_kernel
    return compiled_kernels(kernel_fn, functools.partial(gemv.gemv, x, weight, config=config, **kwargs))[0]


def cuobjdump(cubin: bytes, flag: str) -> str:
    """cuobjdump (shipped with Triton) on a cubin."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True).stdout


def print_sass(spec: str, kernel) -> None:
    sass = cuobjdump(kernel.asm["cubin"], "-sass")
    opcode = r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)"
    ops = collections.Counter(m.group(1) for m in re.finditer(opcode, sass, re.M))
    print(f"{spec}: {sum(ops.values())} SASS instructions; {dict(ops.most_common(16))}")
    if os.environ.get("GEMV_SASS_OUT"):
        Path(os.environ["GEMV_SASS_OUT"]).write_text(sass)
        Path(os.environ["GEMV_SASS_OUT"] + ".ttgir").write_text(kernel.asm["ttgir"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--format", choices=("int4", "fp8"), default="int4")
    parser.add_argument("--one-row", action="store_true", help="int4: tgi_compat.kernels.gemv.int4_one_row's kernel")
    parser.add_argument("--sass", action="store_true", help="also count the SASS opcodes of the kernel")
    parser.add_argument("cases", nargs="+")
    args = parser.parse_args()
    install_compile_only_driver()
    for spec in args.cases:
        kernel = compile_case(spec, args.format, args.one_row)
        if args.sass:
            print_sass(spec, kernel)
        found = re.search(
            r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", cuobjdump(kernel.asm["cubin"], "-res-usage")
        )
        ptx = kernel.asm["ptx"]
        loads = collections.Counter(m.group(0) for m in re.finditer(r"ld\.global[.\w]*", ptx))
        print(
            f"{spec}: registers {found.group(1)}, stack {found.group(2)} B, shared {kernel.metadata.shared} B; "
            f"bar.sync {ptx.count('bar.sync')}, st.shared {len(re.findall(r'st[.]shared', ptx))}; {dict(loads)}"
        )


if __name__ == "__main__":
    main()
