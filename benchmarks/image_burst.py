"""A burst of images through the API's own fetcher (its 16 fetch threads, Qwen-VL's decode and resize): at several
caps on the images its threads decode at once (`ImageFetcher.decoding`), and with the decodes in worker processes
(`ImageDecoder`): when the first, the median and the last image are back. CPU only.

    python -m benchmarks.image_burst                      # 16 noise PNGs of 1024px, caps 16, 4, 2, 1
    python -m benchmarks.image_burst --images 32 --caps 16,8 --processes 4,8
    python -m benchmarks.image_burst --images 4 --size 112 --caps 4,1 --processes 2

Decodes in threads share the API's GIL, take it back for every chunk of the file and finish late together; the
engine takes each image as soon as it is back (session 39)."""

from __future__ import annotations

import argparse
import base64
import io
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from PIL import Image

from benchmarks.device.qwen_vl import api_vision, write_folder
from tgi_compat.api.protocol.images import ImageRef, Resize, image_markdown
from tgi_compat.api.serving.image_decode import ImageDecoder
from tgi_compat.api.serving.image_fetch import FETCH_THREADS, DecodedImages, ImageFetcher


def noise_refs(count: int, size: int) -> list[ImageRef]:
    refs = []
    for seed in range(count):
        out = io.BytesIO()
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(out, "PNG")
        refs.append(ImageRef(image_markdown(f"data:image/png;base64,{base64.b64encode(out.getvalue()).decode()}")))
    return refs


def qwen_vl_resize() -> Resize:
    """The API's own resize for Qwen2.5-VL-7B's processor (its released min/max_pixels)."""
    folder = Path(tempfile.mkdtemp(prefix="image-burst-"))
    write_folder(folder, "7b")
    resize = api_vision(str(folder)).resize
    assert resize is not None
    return resize


def burst(refs: list[ImageRef], cap: int, resize: Resize, processes: int = 0) -> list[float]:
    """Each image's ms from the burst's start until it is back, sorted: all submitted at once, as a burst of requests
    submits theirs. `processes`: the API's decoders in that many worker processes (started before the clock)."""
    decoder = ImageDecoder(processes)
    decoder.warm()
    fetcher = ImageFetcher(decoded=DecodedImages(decoder=decoder), decoding=threading.Semaphore(cap))
    start = time.perf_counter()

    def load(ref: ImageRef) -> float:
        fetcher.load(ref, resize)
        return 1e3 * (time.perf_counter() - start)

    back = sorted(future.result() for future in [fetcher.threads.submit(load, ref) for ref in refs])
    fetcher.threads.shutdown()
    decoder.close()
    return back


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--caps", default="16,4,2,1", help="decodes at once in the fetch threads (no processes)")
    parser.add_argument("--processes", default="", help="worker processes to decode in (each with no cap), e.g. 4,8")
    args = parser.parse_args()
    refs, resize = noise_refs(args.images, args.size), qwen_vl_resize()
    burst(refs[:1], 1, resize)  # first calls
    rows = ["| decoders | first back ms | median ms | last ms |", "|---|---|---|---|"]
    runs = [(0, int(cap)) for cap in args.caps.split(",") if cap]
    runs += [(int(n), FETCH_THREADS) for n in args.processes.split(",") if n]
    for processes, cap in runs:
        back = burst(refs, cap, resize, processes)
        mode = f"{processes} processes" if processes else f"threads, {cap} at once"
        rows.append(f"| {mode} | {back[0]:.0f} | {back[len(back) // 2]:.0f} | {back[-1]:.0f} |")
    print(f"{args.images} noise PNGs of {args.size}px, Qwen-VL's decode and resize in the API's fetcher\n")
    print("\n".join(rows), flush=True)


if __name__ == "__main__":
    main()
