"""The one-shot all-reduce moves 16-byte vectors once compiled for the GPU.

Its peers' buffers come in as int64 addresses, so the compiler knows nothing of their alignment, and an
unspecialized element count leaves the masks' divisibility unknown: compiled that way, every thread sent its 16
elements to each peer as 16 two-byte stores (each warp instruction touching 32 sectors across NVLink) and polled
them with 16 two-byte loads. The interpreter cannot show this, so here the kernel is compiled for sm_90 without a
GPU (benchmarks/compile_only.py's compile-only driver, in a process of its own: this one runs the
interpreter), and the loads of x, the stores to the peers and the polls of its own buffer must be 16-byte wide,
in the sums, in the gather of vocab-parallel logits and in the sum fused with the residual add and RMSNorm.
"""

from __future__ import annotations

from benchmarks.compile_only import run_probe

PROBE = r"""
import json, re, torch
from benchmarks.compile_only import compiled_ptx, install_compile_only_driver
install_compile_only_driver()
from tgi_compat.kernels.comm import one_shot_all_reduce as ar
found = {}
for world in (2, 4):
    for dtype in (torch.bfloat16, torch.float16):
        x, halves = torch.zeros(8 * 4096, dtype=dtype), torch.zeros(ar.MAX_PROGRAMS, dtype=torch.int32)
        buffer_ptrs = torch.zeros(world, dtype=torch.int64)
        ptx = compiled_ptx(ar._one_shot_all_reduce_kernel,
                           lambda: ar.one_shot_all_reduce_(x, buffer_ptrs, halves, 1 << 19, 0))
        ops = re.findall(r"\b(ld|st)(\.volatile)?\.global(\.\w+)*?\.(v4\.b32|b16|b32|b64|u16)\b", ptx)
        found[f"{world} {dtype}"] = sorted({f"{op}{vol}.{width}" for op, vol, _, width in ops})
    logits = torch.zeros(2, 64128, dtype=torch.bfloat16)  # Llama-3's vocabulary over 2 ranks, 2 rows
    ptx = compiled_ptx(ar._one_shot_all_reduce_kernel,
                       lambda: ar.one_shot_all_gather(logits, buffer_ptrs, halves, 1 << 19, 0))
    ops = re.findall(r"\b(ld|st)(\.volatile)?\.global(\.\w+)*?\.(v4\.b32|b16|b32|b64|u16)\b", ptx)
    found[f"gather {world}"] = sorted({f"{op}{vol}.{width}" for op, vol, _, width in ops})
    rows, weight = torch.zeros(4, 4096, dtype=torch.bfloat16), torch.zeros(4096, dtype=torch.bfloat16)
    ptx = compiled_ptx(ar._one_shot_all_reduce_rmsnorm_kernel,
                       lambda: ar.one_shot_all_reduce_rmsnorm(rows, rows, weight, 1e-5, buffer_ptrs, halves, 1 << 19, 0))
    ops = re.findall(r"\b(ld|st)(\.volatile)?\.global(\.\w+)*?\.(v4\.b32|b16|b32|b64|u16)\b", ptx)
    found[f"rmsnorm {world}"] = sorted({f"{op}{vol}.{width}" for op, vol, _, width in ops})
print(json.dumps(found))
"""


def test_all_reduce_compiles_to_16_byte_loads_and_stores():
    found = run_probe(PROBE)
    assert isinstance(found, dict)
    assert len(found) == 8, found
    for name, widths in found.items():  # the sums at 2 and 4 ranks, the gather, the sum with residual and RMSNorm
        # x, the peers' stores, the polls and the sentinels put back: v4.b32; the scalars: the program's half
        # (b32) and the buffer addresses (b64). No two-byte access anywhere.
        assert {"ld.v4.b32", "st.v4.b32", "ld.volatile.v4.b32"} <= set(widths), widths
        assert not any(w.endswith(("b16", "u16")) for w in widths), (name, widths)
