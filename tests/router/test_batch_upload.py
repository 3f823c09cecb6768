"""The packed host-to-device upload of a step's int columns: values as given, and every row 16-byte aligned."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.router.batch import upload


@pytest.mark.parametrize("width", [1, 2, 63, 64, 65])
def test_every_row_of_an_upload_starts_16_byte_aligned(width):
    """Triton compiles a kernel anew for a pointer off 16 bytes: a step's out_slots (row 1) of an odd batch once
    compiled the KV store in the middle of serving."""
    rows = [[r * 1000 + i for i in range(width)] for r in range(6)]
    packed = upload(rows, torch.device("cpu"))
    assert packed.shape == (6, width) and packed.tolist() == rows
    assert all(packed[r].data_ptr() % 16 == 0 for r in range(6))
