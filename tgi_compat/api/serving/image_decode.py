"""A prompt's images decoded (and resized, Qwen-VL's) in worker processes of the API's, as SGLang's multimodal
processors run theirs.

In the API's own threads the decodes share its GIL: Pillow's decoder takes it back for every chunk of the file it
reads, the threads then progress round-robin and a burst's images all come back late together. On the H100 host a
burst of 32 1024px PNGs through 16 threads brought its first image back after ~360 ms and its last after ~680 ms,
for ~58 ms of work an image (benchmarks.image_burst, session 40).

A worker imports this module and Pillow, never torch: the resize's sides are worked out here, from the file's header
(which Pillow reads without decoding), and sent with the file. The file and the resized pixels travel as files in /dev/shm: read and written whole in one system
call each, without the GIL, where a pipe moves them 64 KiB and one GIL hand-over at a time."""

from __future__ import annotations

import io
import multiprocessing
import os
import tempfile
import threading
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

from PIL import Image as PILImage

from tgi_compat.api.protocol.errors import TgiError, validation_error
from tgi_compat.api.protocol.images import DECODE_ERRORS, DecodedImage, Resize, ResizedImage, decode_image

MAX_DECODE_PROCESSES = 8
WARM_S = 60.0  # the longest `warm` waits for every worker to answer (their imports, on a slow or busy host)
_SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def decode_processes(cpus: int | None = None) -> int:
    """Half the host's cores, 8 at most (the engine's process and the API's event loop need theirs); none under 4
    cores, where the fetch threads decode (the processes would only add their start-up and copies)."""
    cpus = cpus or os.cpu_count() or 1
    return 0 if cpus < 4 else min(MAX_DECODE_PROCESSES, cpus // 2)


@dataclass(frozen=True, slots=True)
class _Job:
    """An image for a worker: its file's path, its declared mime type, the sides to resize it to (height, width; None:
    decoded only, to validate it) with the filter `resample`, and the path for the resized pixels."""

    source: str
    mimetype: str | None
    sides: tuple[int, int] | None
    resample: int
    out: str


@dataclass(frozen=True, slots=True)
class _Decoded:
    """A worker's answer: the image's size and mime type (its resized pixels in the job's `out`); or the decoder's
    refusal, TgiError's fields."""

    width: int = 0
    height: int = 0
    mimetype: str = ""
    refused: tuple[int, str, str, str] | None = None


def _decode_file(job: _Job) -> _Decoded:
    """In a worker: decode_image of the job's file, resized to its sides."""
    sides = job.sides
    resize = None if sides is None else Resize(lambda height, width: sides, job.resample)
    try:
        image = decode_image(Path(job.source).read_bytes(), job.mimetype, resize, digest="-")
    except TgiError as error:  # TGI's text goes back to the API, which raises it there
        return _Decoded(refused=(error.status, error.message, error.error_type, error.metric_label))
    if image.resized is not None:
        Path(job.out).write_bytes(image.resized.data)
    return _Decoded(image.width, image.height, image.mimetype)


class ImageDecoder:
    """`decode_image` in `processes` workers (started with the first image, or by `warm`); 0: in the calling thread."""

    def __init__(self, processes: int = 0) -> None:
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def decode(self, data: bytes, mimetype: str | None, resize: Resize | None, digest: str) -> DecodedImage:
        """decode_image's (blocking: a fetch thread calls it), with its errors' texts."""
        if self.processes == 0:
            return decode_image(data, mimetype, resize, digest)
        try:
            with PILImage.open(io.BytesIO(data)) as header:  # the header alone: no pixel is decoded here
                height, width = header.height, header.width
            sides = None if resize is None else resize.sides(height, width)
        except DECODE_ERRORS:  # not an image, or a size the resize refuses: decode_image's own error
            return decode_image(data, mimetype, resize, digest)
        source = _SHM / f"tgi-image-{uuid.uuid4().hex}"
        out = source.with_suffix(".resized")
        try:
            source.write_bytes(data)
            decoded = self._run(_Job(str(source), mimetype, sides, resize.resample if resize else 0, str(out)))
            if decoded.refused is not None:
                raise TgiError(*decoded.refused)
            resized = None if sides is None else ResizedImage(out.read_bytes(), *sides)
        except OSError:  # /dev/shm full (Docker gives 64 MB unless --shm-size says more): decoded here instead
            return decode_image(data, mimetype, resize, digest)
        finally:
            source.unlink(missing_ok=True)
            out.unlink(missing_ok=True)
        return DecodedImage(data, decoded.mimetype, decoded.width, decoded.height, resized, digest)

    def _run(self, job: _Job) -> _Decoded:
        """One try again on a fresh pool where a worker died (another image's decoder crashing it, or this one's:
        then it fails twice and is refused)."""
        for _ in range(2):
            pool = self.pool
            try:
                return pool.submit(_decode_file, job).result()
            except BrokenProcessPool:
                self._drop(pool)
        raise validation_error("invalid image: its decoder crashed")

    def warm(self) -> set[int]:
        """Every worker started, its imports done and Pillow's format plugins loaded, before the first image waits for
        them. A pool of spawned workers starts one a task as tasks come; a worker still importing takes none, so the
        first to be up could run every warm-up task while the others were still starting (and then took the first
        images' cores and time): tasks go out until each worker has answered one, for `WARM_S` at most (the pool
        spawns a worker for a task only where none is idle). Returns the pids of the workers that answered."""
        seen: set[int] = set()
        if not self.processes:
            return seen
        pool, deadline = self.pool, time.monotonic() + WARM_S
        while len(seen) < self.processes and time.monotonic() < deadline:
            seen.update(future.result() for future in [pool.submit(_started) for _ in range(self.processes)])
        return seen

    @property
    def pool(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                # spawned, not forked: the API's process has threads (the event loop's, the fetchers')
                self._pool = ProcessPoolExecutor(self.processes, multiprocessing.get_context("spawn"))
            return self._pool

    def _drop(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """The workers stopped and joined (waiting for the decodes under way). In a process of multiprocessing's own,
        an idle worker left running would hang its exit, which joins its children after closing the queue that would
        have told the worker to stop."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _started() -> int:
    """A worker's warm-up task (its imports are done once it runs): Pillow's plugins loaded (an image's first open
    would), a moment's wait so that the other workers take the tasks sent beside it, and its pid."""
    PILImage.init()
    time.sleep(0.02)
    return os.getpid()
