"""Prompt images decoded and resized by Pillow in child processes, one image at a time each.

In threads of the engine's process, this work slowed the engine's own thread, which takes the GIL back after each
kernel launch. On an H100 with 32 streams of a 1024px image, TTFT p50 was 1,029 ms with the resize in three threads,
against 879 ms for images processed before they were sent (session 37). A child has its own interpreter. The engine
keeps only the pipe reads, which wait without the GIL, and one thread per child to make them.

The children import Pillow alone and start in about 0.1 s, with the pool's first image. They are started with
`python -m` on this module, not with multiprocessing: the engine's process is a daemon, and multiprocessing does not
allow a daemon to have children. A child reads until its pipe closes, which happens when the engine's process ends,
however it ends."""

from __future__ import annotations

import io
import logging
import multiprocessing
import queue
import subprocess
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the child runs this module and imports Pillow alone
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResizeJob:
    data: bytes  # the image file
    size: tuple[int, int]  # (width, height) to resize to
    resample: int  # Pillow's filter
    future: Future[torch.Tensor]  # the resized RGB image [height, width, 3] uint8


class ResizeError(ValueError):
    """The child could not decode or resize the image, or it exited."""


class ResizePool:
    """`workers` children, each with a thread of this process that hands it jobs from one queue."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._jobs: queue.SimpleQueue[ResizeJob | None] = queue.SimpleQueue()  # None: a thread's end
        self._lock = threading.Lock()
        self._started = self._closed = False

    def submit(self, data: bytes, size: tuple[int, int], resample: int) -> Future[torch.Tensor]:
        """The image file `data` decoded, converted to RGB and resized to `size` (width, height)."""
        future: Future[torch.Tensor] = Future()
        self._start()
        self._jobs.put(ResizeJob(data, size, resample, future))
        return future

    def close(self) -> None:
        """End the threads and their children once the jobs queued before are done."""
        with self._lock:
            started, self._closed = self._started, True
        for _ in range(self.workers if started else 0):
            self._jobs.put(None)

    def _start(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the image resize pool is closed")
            if self._started:
                return
            self._started = True
        for index in range(self.workers):
            threading.Thread(target=self._serve, name=f"image-resize-{index}", daemon=True).start()

    def _serve(self) -> None:
        """One thread per child: hands it the next job and waits for its answer (a pipe read: no GIL held)."""
        child: _Child | None = None
        while True:
            job = self._jobs.get()
            if job is None:
                if child is not None:
                    child.close()
                return
            if not job.future.set_running_or_notify_cancel():
                continue
            if child is not None and child.process.poll() is not None:  # it died between jobs: a new one for this
                child.close()
                child = None
            try:
                child = child or _Child()
                job.future.set_result(child.resize(job))
            except ResizeError as error:
                job.future.set_exception(error)
            except (EOFError, OSError) as error:  # it died on this job (killed, out of memory): a new one for the next
                if child is not None:
                    child.close()
                child = None
                logger.warning("an image resize process exited: %s", error)
                job.future.set_exception(ResizeError(f"the image resize process exited ({error})"))


class _Child:
    def __init__(self) -> None:
        parent_end, child_end = multiprocessing.Pipe()
        command = [sys.executable, "-m", __name__, str(child_end.fileno())]
        self.process = subprocess.Popen(command, pass_fds=[child_end.fileno()])
        child_end.close()
        self.connection = parent_end

    def resize(self, job: ResizeJob) -> torch.Tensor:
        import torch

        self.connection.send((job.data, job.size, job.resample))
        answer = self.connection.recv()
        if answer[0] == "error":
            raise ResizeError(answer[1])
        _, height, width = answer
        pixels = bytearray(height * width * 3)  # writable: the tensor shares it
        self.connection.recv_bytes_into(pixels)
        return torch.frombuffer(pixels, dtype=torch.uint8).view(height, width, 3)

    def close(self) -> None:
        """Its pipe closed: it ends at its next read (and is killed if it is stuck in an image)."""
        self.connection.close()
        try:
            self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def serve(connection: Connection) -> None:
    """The child: decode and resize what the pipe brings until it closes."""
    from PIL import Image

    while True:
        try:
            data, size, resample = connection.recv()
        except (EOFError, OSError):  # the engine's process closed the pipe, or ended
            return
        try:
            image = Image.open(io.BytesIO(data)).convert("RGB").resize(size, resample=resample)
        except Exception as error:  # whatever Pillow raises on a bad file: the parent's job fails, not the child
            connection.send(("error", f"{type(error).__name__}: {error}"))
            continue
        connection.send(("ok", image.height, image.width))
        connection.send_bytes(image.tobytes())


if __name__ == "__main__":  # the child: python -m tgi_compat.modeling.vision.resize_pool FD
    serve(Connection(int(sys.argv[1])))
