"""The health monitor's decisions, against a scripted stand-in for the engine client.

(End-to-end behaviour with the real engine process is in integration-tests/test_ops.py.)
"""

import asyncio

from tgi_compat.api.server.health_monitor import EngineHealthMonitor, HealthMonitorConfig
from tgi_compat.router.client_api import EngineClient, EngineDeadError, EngineInfo

FAST = dict(check_interval_s=0.02, check_timeout_s=0.05, liveness_interval_s=0.01, failure_threshold=3)


class ScriptedEngine(EngineClient):
    """Answers health steps as told: "ok", "fail", "hang"; `alive` can be switched off."""

    info = EngineInfo("m", "llama", "float32", "cpu", 10, 10, 10, 10, (2,))
    can_restart = True

    def __init__(self, answers=("ok",), restartable=True, restart_ok=True):
        self.answers = list(answers)
        self.alive = True
        self.checks = 0
        self.restart_calls = 0
        self.restart_ok = restart_ok
        self.can_restart = restartable

    @property
    def is_dead(self) -> bool:
        return not self.alive

    async def check_health(self) -> bool:
        self.checks += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if answer == "hang":
            await asyncio.sleep(10)
        if answer == "dead":
            raise EngineDeadError("gone")
        return answer == "ok"

    async def restart(self) -> None:
        self.restart_calls += 1
        if not self.restart_ok:
            raise RuntimeError("model failed to load")
        self.alive = True
        self.answers = ["ok"]

    def generate(self, request):
        raise NotImplementedError

    async def abort(self, request_id):
        pass

    async def shutdown(self):
        pass


async def wait_until(predicate, timeout=3.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_healthy_engine_is_left_alone():
    engine = ScriptedEngine(["ok"])
    monitor = EngineHealthMonitor(engine, HealthMonitorConfig(**FAST), on_fatal=lambda r: None)
    monitor.start()
    await wait_until(lambda: engine.checks >= 3)
    await monitor.stop()
    assert monitor.healthy and engine.restart_calls == 0


async def test_dead_process_is_restarted_at_once():
    engine = ScriptedEngine(["ok"])
    monitor = EngineHealthMonitor(
        engine, HealthMonitorConfig(**{**FAST, "check_interval_s": 60}), on_fatal=lambda r: None
    )
    monitor.start()
    engine.alive = False
    await wait_until(lambda: monitor.restarts == 1)
    await monitor.stop()
    assert engine.restart_calls == 1 and monitor.healthy


async def test_hung_steps_restart_after_the_threshold():
    engine = ScriptedEngine(["ok", "hang", "fail", "hang", "ok"])
    monitor = EngineHealthMonitor(engine, HealthMonitorConfig(**FAST), on_fatal=lambda r: None)
    monitor.start()
    await wait_until(lambda: not monitor.healthy)
    await wait_until(lambda: monitor.restarts == 1)
    await monitor.stop()
    assert engine.restart_calls == 1 and monitor.healthy and monitor.consecutive_failures == 0


async def test_one_miss_below_the_threshold_recovers_without_restart():
    engine = ScriptedEngine(["fail", "ok"])
    monitor = EngineHealthMonitor(engine, HealthMonitorConfig(**FAST), on_fatal=lambda r: None)
    monitor.start()
    await wait_until(lambda: engine.checks >= 3)
    await monitor.stop()
    assert engine.restart_calls == 0 and monitor.healthy


async def test_without_restart_a_dead_engine_stops_the_server():
    reasons = []
    engine = ScriptedEngine(["ok"], restartable=False)
    monitor = EngineHealthMonitor(engine, HealthMonitorConfig(**FAST), on_fatal=reasons.append)
    task = monitor.start()
    engine.alive = False
    await asyncio.wait_for(task, 3)  # the monitor ends after giving up
    assert reasons == ["the engine process died"] and not monitor.healthy


async def test_failed_restart_is_fatal():
    reasons = []
    engine = ScriptedEngine(["dead"], restart_ok=False)
    monitor = EngineHealthMonitor(engine, HealthMonitorConfig(**FAST), on_fatal=reasons.append)
    await asyncio.wait_for(monitor.start(), 3)
    assert engine.restart_calls == 1
    assert reasons and "restart failed: model failed to load" in reasons[0]


async def test_is_dead_property_is_understood():
    engine = ScriptedEngine(["ok"])
    monitor = EngineHealthMonitor(
        engine, HealthMonitorConfig(**{**FAST, "check_interval_s": 60}), on_fatal=lambda r: None
    )
    monitor.start()
    engine.alive = False
    await wait_until(lambda: monitor.restarts == 1)
    await monitor.stop()
