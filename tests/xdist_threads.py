"""pytest-xdist's workers share the cores: each worker, and every process it starts (servers, engines, ranks),
computes on its share of them.

Two workers on CI's 2 cores with torch's default of a thread per core oversubscribe the cores: OpenMP's
threads spin waiting for each other, and the same tests took twice as long as one process did. With one thread
per worker they take 25% less (tests/README.md).
"""

from __future__ import annotations

import os


def share_the_cores_among_xdist_workers() -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "PYTEST_XDIST_WORKER" not in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the processes the tests start inherit it
    import torch

    torch.set_num_threads(threads)
