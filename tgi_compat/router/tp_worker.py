"""A tensor-parallel rank > 0 in its own process: load this rank's shard, then run the forward of
every step rank 0 broadcasts, until rank 0 sends stop.

The API process starts these beside the engine process (rank 0) and watches them all: a rank that
dies is an engine death (tgi_compat.router.client), and so is one that hangs (tgi_compat.router.rank_heartbeat).
A worker never outlives the API process: the kernel kills it when its parent dies (PR_SET_PDEATHSIG),
and a watch thread covers systems without that.
"""

from __future__ import annotations

import logging
import os

from tgi_compat.router.config import EngineConfig
from tgi_compat.router.process_exit import exit_process, exit_with_parent, name_process
from tgi_compat.router.rank_heartbeat import RankHeartbeats

logger = logging.getLogger(__name__)


def run_tp_worker(config: EngineConfig, rank: int, parent_pid: int, heartbeats: RankHeartbeats) -> None:
    heartbeats.start_beating(rank)
    exit_with_parent(parent_pid)
    name_process(f"tp-rank-{rank}")  # what ps/top show (and how tests find a rank)
    from tgi_compat.modeling.parallel.step_broadcast import StepBroadcast
    from tgi_compat.router.model_loading import load_runner

    logger.info("tensor-parallel rank %d: pid %d", rank, os.getpid())
    runner = load_runner(config, rank)
    hidden = runner.model_config.hidden_size  # the width of an image step's feature rows
    runner.follow_rank_zero(StepBroadcast(runner.tp, on_step=heartbeats.step_counter(rank), hidden_size=hidden))
    exit_process(0)  # leaves the group too (no destroy_process_group: see exit_process)
