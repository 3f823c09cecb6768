"""tgi_compat.kernels.comm.l2_prefetch compiles for sm_90 to TMA bulk prefetches into L2 with the evict_last hint, one per thread.

The interpreter has no counterpart of the instruction, so the kernel is compiled without a GPU (the compile-only
driver of benchmarks/compile_only.py, in a process of its own); the GPU tests run it. Beside it: the helper that
forks it beside an all-reduce does nothing where it cannot run (CPU tensors, compute-bound widths).
"""

from __future__ import annotations

import torch

from benchmarks.compile_only import run_probe
from tgi_compat.modeling.layers.weight_prefetch import PREFETCH_MAX_ROWS, weight_prefetched_beside

PROBE = r"""
import json, re, torch
from benchmarks.compile_only import compiled_ptx, install_compile_only_driver
install_compile_only_driver()
from tgi_compat.kernels.comm import l2_prefetch as pf
weight = torch.zeros(4096, 2048, dtype=torch.bfloat16)
ptx = compiled_ptx(pf._l2_prefetch_kernel, lambda: pf.l2_prefetch(weight, 8 << 20))
lines = [line.strip() for line in ptx.splitlines()]
print(json.dumps({
    "prefetches": [l for l in lines if l.startswith("@") and "cp.async.bulk.prefetch" in l],
    "policies": [l for l in lines if l.startswith("createpolicy")],
    "stores": [l for l in lines if re.match(r"(@\S+ )?st\.", l)],
}))
"""


def test_prefetch_compiles_to_bulk_l2_prefetches():
    found = run_probe(PROBE)
    assert isinstance(found, dict)
    # one predicated request a thread (the chunks past the tensor's end ask for nothing), tagged evict_last
    assert len(found["prefetches"]) == 1, found
    assert "cp.async.bulk.prefetch.L2.global.L2::cache_hint" in found["prefetches"][0]
    assert found["policies"] == ["createpolicy.fractional.L2::evict_last.b64 policy, 1.0;"], found
    assert found["stores"] == [], found  # it writes nothing


def test_prefetch_beside_is_a_no_op_where_it_cannot_help(monkeypatch):
    import tgi_compat.modeling.layers.weight_prefetch as weight_prefetch

    launched = []
    monkeypatch.setattr(weight_prefetch, "l2_prefetch", lambda *args: launched.append(args))
    weight = torch.randn(64, 32)
    for tensor, rows in ((weight, 8), (None, 8), (weight, PREFETCH_MAX_ROWS + 1)):  # CPU, quantized, compute-bound
        with weight_prefetched_beside(tensor, rows):
            ran = True
        assert ran
    assert launched == []
