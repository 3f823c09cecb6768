"""What the GPU kernel tests share: the checks each test records and prints, and a paged KV cache of scattered
slots (test_attention_gpu.py, test_kernels_gpu.py, test_runtime_gpu.py)."""

from __future__ import annotations

import pytest
import torch

DEV = "cuda"
RESULTS: list[tuple[str, float, float]] = []  # (check, error, threshold)

GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def every_check_passes():
    """A test runs all its checks (each printed), then fails if any missed its threshold."""
    torch.manual_seed(0)
    RESULTS.clear()
    yield
    failed = [r for r in RESULTS if not r[1] < r[2]]
    assert not failed, failed


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.isnan().any():
        return float("inf")
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def check(name: str, err: float, threshold: float, measure: str = "rel err") -> None:
    RESULTS.append((name, err, threshold))
    print(f"{'PASS' if err < threshold else 'FAIL'} {name}: {measure} {err:.2e} (< {threshold:.0e})", flush=True)


def check_bits(name: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    """`out` holds `ref`'s bits but in at most 1% of its elements, where 1/rms differed in its last bit (torch's
    rsqrt against the kernel's sqrt and divide, another sum order) and flipped a rounding; those stay small."""
    check(f"{name}: elements not bit-equal", (out != ref).float().mean().item(), 1e-2, "fraction")
    check(f"{name}", rel_err(out, ref), 1e-3)


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 1e-2


def paged_cache(kv_lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    """KV cache with every request's tokens in scattered slots (a random permutation)."""
    max_len = max(kv_lens)
    num_slots = len(kv_lens) * max_len + 7
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, device=DEV, dtype=dtype)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, device=DEV, dtype=dtype)
    req_to_token = torch.randperm(num_slots, device=DEV)[: len(kv_lens) * max_len].view(len(kv_lens), max_len)
    rows = torch.randperm(len(kv_lens), device=DEV)
    return k_cache, v_cache, req_to_token.to(torch.int32).contiguous(), rows
