"""The resize pool's child processes (tgi_compat/modeling/vision/resize_pool.py): they give Pillow's own decode and
resize, for several jobs at once. A file Pillow cannot read fails its job and nothing else. A child that died
between jobs is replaced for the next one. Closing the pool ends the children."""

from __future__ import annotations

import io
import os
import signal
import time

import numpy as np
import pytest
import torch
from PIL import Image

from tgi_compat.modeling.vision.resize_pool import ResizeError, ResizePool


def image_file(height: int, width: int, seed: int, fmt: str = "PNG") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def pillow(data: bytes, size: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB").resize(size, Image.BICUBIC)))


@pytest.fixture
def pool():
    pool = ResizePool(2)
    yield pool
    pool.close()


def test_children_resize_as_pillow_does_several_at_once(pool):
    jobs = [(image_file(90 + 7 * i, 61 + 5 * i, i, "PNG" if i % 2 else "JPEG"), (56 + 28 * i, 84)) for i in range(5)]
    futures = [pool.submit(data, size, int(Image.BICUBIC)) for data, size in jobs]
    for (data, size), future in zip(jobs, futures):
        got = future.result(timeout=60)
        assert got.dtype == torch.uint8 and got.shape == (size[1], size[0], 3)
        assert torch.equal(got, pillow(data, size))


def test_an_unreadable_file_fails_its_job_alone(pool):
    bad = pool.submit(b"not an image", (28, 28), int(Image.BICUBIC))
    with pytest.raises(ResizeError, match="UnidentifiedImageError"):
        bad.result(timeout=60)
    data = image_file(40, 40, 0)
    assert torch.equal(pool.submit(data, (28, 28), int(Image.BICUBIC)).result(timeout=60), pillow(data, (28, 28)))


def children(parent: int) -> set[int]:
    """This process's children running the pool's module (from /proc)."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat, open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == parent and b"resize_pool" in cmdline.read():
                    found.add(int(pid))
        except (OSError, IndexError, ValueError):
            continue
    return found


def wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_child_that_died_between_jobs_is_replaced_and_closing_ends_the_children():
    pool = ResizePool(1)
    data = image_file(40, 40, 0)
    pool.submit(data, (28, 28), int(Image.BICUBIC)).result(timeout=60)
    (child,) = children(os.getpid())
    os.kill(child, signal.SIGKILL)
    assert wait_for(lambda: child not in children(os.getpid()))
    assert torch.equal(pool.submit(data, (28, 28), int(Image.BICUBIC)).result(timeout=60), pillow(data, (28, 28)))
    (other,) = children(os.getpid())
    assert other != child
    pool.close()
    assert wait_for(lambda: not children(os.getpid())), "closing the pool ends its children"
