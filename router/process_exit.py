"""How an engine process (rank 0, or a tensor-parallel rank) leaves once its own cleanup is done."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_process(code: int = 0) -> NoReturn:
    """Exit now, without the interpreter's teardown. A process that held NCCL communicators spent ~13 s in
    that teardown after `destroy_process_group` had returned (2x H200, torch 2.11, BENCHMARKS.md): longer
    than the client waits for a requested exit, so every sharded shutdown ended with the ranks killed.
    Nothing is left to release by then (the group is destroyed, the sockets closed; the driver frees the
    GPU memory with the process), so only the log and stdio buffers need flushing."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
