"""The shared-prefix kernels compile for sm_90 at Llama-3-8B attention shapes (bf16 and an FP8 cache, both key
blocks), without a GPU (benchmarks/compile_only.py's driver, in a process of its own): the interpreter accepts code
that Triton's compiler may reject, and the CPU tests run small shapes in fp32/fp16 only."""

from __future__ import annotations

from benchmarks.compile_only import run_probe

PROBE = r"""
import json, torch
from benchmarks.compile_only import install_compile_only_driver
install_compile_only_driver()
from triton.compiler import compiler
names = []
def record(self):  # compiled: note it and launch nothing (benchmarks/compile_only.py's --dump does the same)
    if self.module is None:
        names.append(self.name)
        self.module = "compile-only"
        self._run = lambda *args: None
compiler.CompiledKernel._init_handles = record
from tgi_compat.kernels.attention.shared_prefix import shared_prefix_decode_attention
from tgi_compat.modeling.forward_batch import PrefixGroups
batch, slots = 64, 4096
q = torch.zeros(batch, 32, 128, dtype=torch.bfloat16)
table = torch.tensor(PrefixGroups.rows([(2000, list(range(8)))], batch, 8))
for cache_dtype, block_n in ((torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float8_e4m3fn, 64)):
    cache = torch.zeros(slots, 8, 128, dtype=cache_dtype)
    r2t = torch.zeros(batch + 1, 2304, dtype=torch.int32)
    lens = torch.full((batch,), 2100)
    shared_prefix_decode_attention(q, cache, cache, r2t, torch.arange(batch), lens, table, 0.088, 1, 4, block_n=block_n)
# the group programs reading their members' own keys: partials, and final outputs (one split each way)
cache = torch.zeros(slots, 8, 128, dtype=torch.bfloat16)
for prefix_splits in (4, 1):
    shared_prefix_decode_attention(
        q, cache, cache, r2t, torch.arange(batch), lens, table, 0.088, 1, prefix_splits, group_suffix=True
    )
print(json.dumps(names))
"""


def test_shared_prefix_kernels_compile_for_sm90_at_llama3_8b_shapes():
    names = run_probe(PROBE)
    assert isinstance(names, list)
    # bf16 at two suffix key blocks, FP8; the group-suffix kernel with partials and final
    assert names.count("_shared_prefix_kernel") == 5, names
    assert "_decode_stage2_kernel" in names
