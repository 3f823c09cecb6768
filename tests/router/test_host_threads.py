"""A GPU engine's host work runs with one PyTorch intra-op thread unless OMP_NUM_THREADS says how many
(router/model_loading._gpu_host_threads); a CPU engine keeps its threads, which do its arithmetic."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.router.model_loading import _gpu_host_threads


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("device", "omp", "expected"),
    [("cuda", None, 1), ("cuda", "2", 2), ("cpu", None, 2)],
    ids=["gpu", "omp-set", "cpu"],
)
def test_a_gpu_engine_takes_one_intra_op_thread_unless_told(threads, monkeypatch, device, omp, expected):
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    _gpu_host_threads(torch.device(device))
    assert torch.get_num_threads() == expected
