"""Engine health monitor: LightLLM's `--health_monitor`, adapted to one API process + one engine.

LightLLM runs a separate process that, every HEALTH_CHECK_INTERVAL_SECONDS (88), checks the
server's pids and `GET /health` (60 s timeout) and after 3 failures in a row SIGKILLs everything,
leaving the restart to a supervisor. Here the monitor lives in the API process and watches the
engine directly:

  * liveness, every second: `not engine.is_dead`;
  * progress, every `check_interval_s`: `engine.check_health()` within `check_timeout_s` (recent
    token events, else a probe the engine loop answers between two steps: a busy engine passes,
    only one that makes no progress at all fails).

It runs only with `--health-monitor`; without it the server stops only when the engine process
dies (tgi_compat.api.server.process), never because the engine is slow.

A dead process counts at once; a step that fails or hangs counts after `failure_threshold`
consecutive misses. Then, with restarts enabled, `engine.restart()` replaces the engine (which
fails every in-flight request with EngineDeadError -> TGI's 424 `Request failed during
generation: ...`) and serving resumes; without restarts, or when a restart fails, `on_fatal`
stops the server with a non-zero exit, as TGI does when a shard dies. `healthy` is False from the
first miss until a step succeeds again, so `/health` can answer 503 meanwhile.

It uses tgi_compat.router.client_api.EngineClient's `is_dead`, `check_health` and, where `can_restart`,
`restart` (kill the engine if it still runs, fail every pending generate() iterator with
EngineDeadError, start a fresh engine with the same config, return once it is loaded).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from tgi_compat.router.client_api import EngineClient

logger = logging.getLogger("tgi_compat.health_monitor")


@dataclass(frozen=True, slots=True)
class HealthMonitorConfig:
    check_interval_s: float = 88.0  # LightLLM's HEALTH_CHECK_INTERVAL_SECONDS
    check_timeout_s: float = 60.0  # LightLLM's /health timeout
    failure_threshold: int = 3  # consecutive failed steps before acting
    liveness_interval_s: float = 1.0
    restart: bool = True  # False: a dead engine stops the server instead
    restart_timeout_s: float = 600.0  # model load included

    @classmethod
    def from_env(cls, restart: bool = True) -> HealthMonitorConfig:
        return cls(
            check_interval_s=float(os.environ.get("HEALTH_CHECK_INTERVAL_SECONDS", 88)),
            check_timeout_s=float(os.environ.get("HEALTH_CHECK_TIMEOUT_SECONDS", 60)),
            failure_threshold=int(os.environ.get("HEALTH_CHECK_FAILURE_THRESHOLD", 3)),
            restart=restart,
        )


class EngineHealthMonitor:
    def __init__(
        self,
        engine: EngineClient,
        config: HealthMonitorConfig,
        on_fatal: Callable[[str], None],
    ) -> None:
        self.engine = engine
        self.config = config
        self._on_fatal = on_fatal
        self.healthy = True
        self.restarts = 0
        self.consecutive_failures = 0
        self._task: asyncio.Task | None = None

    def _alive(self) -> bool:
        return not self.engine.is_dead

    async def check_step(self) -> bool:
        """One real engine step within the timeout; False on error, refusal or hang."""
        try:
            return bool(await asyncio.wait_for(self.engine.check_health(), self.config.check_timeout_s))
        except TimeoutError:
            logger.warning("Engine health step did not finish within %.0f s", self.config.check_timeout_s)
        except Exception as error:  # EngineDeadError, transport errors
            logger.warning("Engine health step failed: %s", error)
        return False

    async def run(self) -> None:
        next_step = time.monotonic() + self.config.check_interval_s
        while True:
            await asyncio.sleep(self.config.liveness_interval_s)
            if not self._alive():
                if not await self._recover("the engine process died"):
                    return
                next_step = time.monotonic() + self.config.check_interval_s
                continue
            if time.monotonic() < next_step:
                continue
            next_step = time.monotonic() + self.config.check_interval_s
            if await self.check_step():
                self.consecutive_failures = 0
                self.healthy = True
                continue
            self.consecutive_failures += 1
            self.healthy = False
            if self.consecutive_failures >= self.config.failure_threshold:
                reason = f"the engine failed {self.consecutive_failures} health steps in a row"
                if not await self._recover(reason):
                    return

    async def _recover(self, reason: str) -> bool:
        """Restart the engine, or give up on the server. True when serving may go on."""
        self.healthy = False
        if not self.config.restart or not self.engine.can_restart:
            logger.error("Engine unhealthy (%s); stopping the server", reason)
            self._on_fatal(reason)
            return False
        logger.error("Engine unhealthy (%s); restarting it, in-flight requests fail", reason)
        try:
            await asyncio.wait_for(self.engine.restart(), self.config.restart_timeout_s)
        except Exception as error:
            logger.error("Engine restart failed (%s); stopping the server", error)
            self._on_fatal(f"{reason}; restart failed: {error}")
            return False
        self.restarts += 1
        self.consecutive_failures = 0
        self.healthy = await self.check_step()
        logger.info("Engine restarted (%d so far); healthy=%s", self.restarts, self.healthy)
        return True

    def start(self) -> asyncio.Task:
        self._task = asyncio.create_task(self.run(), name="engine-health-monitor")
        return self._task

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
