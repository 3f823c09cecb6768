"""How an engine process (rank 0, a tensor-parallel rank, the grammar compiler) leaves: once its own cleanup
is done, or with its parent."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from typing import NoReturn

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def exit_process(code: int = 0) -> NoReturn:
    """Exit now, without `destroy_process_group` or the interpreter's teardown. On GPUs NCCL's shutdown of
    the group could block: in check_tp_families_gpu both ranks were still inside `destroy_process_group` 10 s
    after their last step (2x H200, torch 2.11, a faulthandler dump), and sharded servers' stops ran into the
    client's wait and ended with their ranks killed. Nothing is left to release by then (the work is done,
    the sockets closed, and the driver frees the GPU memory and the communicators with the process), so
    only the log and stdio buffers need flushing."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def name_process(name: str) -> None:
    """The name ps and top show (and tests find the process by)."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15])
    except (OSError, AttributeError):
        pass


def exit_with_parent(parent_pid: int) -> None:
    """Never outlive the parent: the kernel kills this process when it dies, and a thread checks too."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the thread below still notices within a second
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
