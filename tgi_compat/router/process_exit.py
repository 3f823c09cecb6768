"""How an engine process (rank 0, or a tensor-parallel rank) leaves once its own cleanup is done."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


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
