"""How long the image processor's host half takes in a thread beside a busy Python thread (the engine's, launching
kernels), at several GIL switch intervals (CPU only; session 38's probe of the images' host cost).

    python -m benchmarks.image_gil                        # 1024px noise PNGs, intervals 5, 1, 0.5, 0.2 ms
    python -m benchmarks.image_gil --images 4 --size 448 --intervals 0.005

Pillow returns to Python between its C calls (a PNG decodes one IDAT chunk a call), and each return waits for the GIL;
at Python's default interval (5 ms) a busy thread keeps it that long. The busy thread here is a pure Python loop, the
worst case for the worker; its own rate is reported against the loop alone. On an H100 host, 0.5 ms made a 1024px
PNG's host half 3x faster beside such a loop, but the engine's TTFT with images did not move (session 38: the
interval was tried in the engine's process and taken out again)."""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image


@contextlib.contextmanager
def busy_thread() -> Iterator[list[float]]:
    """A thread spinning in Python while the block runs; the list then holds its iterations per second."""
    stop, rates = threading.Event(), []

    def spin() -> None:
        count, start = 0, time.perf_counter()
        while not stop.is_set():
            for _ in range(1000):
                pass
            count += 1
        rates.append(count / (time.perf_counter() - start))

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        yield rates
    finally:
        stop.set()
        spinner.join()


def ms_per_image(work: Callable[[bytes], None], files: list[bytes], threads: int) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, files))
    return 1e3 * (time.perf_counter() - start) / len(files)


def main() -> None:
    from benchmarks.device.qwen_vl import random_png, write_folder
    from tgi_compat.modeling.vision.processors import image_processor
    from tgi_compat.modeling.vision.qwen_vl_pixels import DevicePatchify

    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=12)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--intervals", default="0.005,0.001,0.0005,0.0002", help="switch intervals, seconds")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="image-gil-"))
    write_folder(folder, "7b")  # Qwen2.5-VL-7B's processor (its resize is the host half)
    patchify = DevicePatchify.of(image_processor(str(folder)))
    assert patchify is not None
    rng = np.random.default_rng(0)
    files = [random_png(rng, args.size) for _ in range(args.images)]

    def work(data: bytes) -> None:
        patchify.resize(Image.open(io.BytesIO(data)).convert("RGB"))

    default = sys.getswitchinterval()
    alone = ms_per_image(work, files, args.threads)
    with busy_thread() as rates:
        time.sleep(0.5)
    print(f"{args.images} PNGs of {args.size}px, {args.threads} thread(s): {alone:.1f} ms an image alone\n")
    print("| switch interval | ms an image beside a busy thread | the busy thread's rate, of alone |")
    print("|---|---|---|")
    try:
        for interval in (float(v) for v in args.intervals.split(",")):
            sys.setswitchinterval(interval)
            with busy_thread() as busy:
                ms = ms_per_image(work, files, args.threads)
            print(f"| {1e3 * interval:g} ms | {ms:.1f} | {busy[0] / rates[0]:.2f} |", flush=True)
    finally:
        sys.setswitchinterval(default)


if __name__ == "__main__":
    main()
