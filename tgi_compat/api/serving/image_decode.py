"""A prompt's images decoded (and resized, Qwen-VL's) in worker processes of the API's, as SGLang's tokenizer manager
does its image processing: Pillow's PNG decoder takes the GIL back for every chunk it reads, so the API's 16 fetch
threads in one process decoded about one image at a time. On the H100 host, 32 streams of a 1024px PNG (qwen_vl,
session 39) got their first image back to the engine after 400-500 ms that way, against about 55 ms from 8 processes.

The file goes to a worker and the decoded image's size and resized pixels come back (the file stays here). A worker
imports the resize's module (Qwen-VL's imports torch): they start with the pool, which starts with the first image."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor

from tgi_compat.api.protocol.images import DecodedImage, Resize, decode_image

# workers at most, and never more than a quarter of the host's cores (the engine's process, the API's event loop and
# its tokenizer threads need theirs); none on a host of under 4: the fetch threads decode, as on a 2-core machine
# the processes would only add their start-up
MAX_DECODE_PROCESSES = 4


def decode_processes(cpus: int | None = None) -> int:
    return min(MAX_DECODE_PROCESSES, (cpus or os.cpu_count() or 1) // 4)


def _decoded(data: bytes, mimetype: str | None, resize: Resize | None) -> DecodedImage:
    """A worker's: the image without its file, which the caller has."""
    return dataclasses.replace(decode_image(data, mimetype, resize), data=b"")


class ImageDecoder:
    """`decode_image` in `processes` workers, started with the first image; 0: in the calling thread."""

    def __init__(self, processes: int = 0) -> None:
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def decode(self, data: bytes, mimetype: str | None, resize: Resize | None) -> DecodedImage:
        """decode_image's (blocking: a fetch thread calls it); its TgiError raised here as the worker raised it."""
        if self.processes == 0:
            return decode_image(data, mimetype, resize)
        return dataclasses.replace(self.pool.submit(_decoded, data, mimetype, resize).result(), data=data)

    @property
    def pool(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                # spawned, not forked: the API's process has threads (the event loop's, the fetchers')
                self._pool = ProcessPoolExecutor(self.processes, multiprocessing.get_context("spawn"))
            return self._pool

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
