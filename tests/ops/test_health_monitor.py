"""The health monitor's decisions, against the scripted engine client (tests/scripted_engine.py).

(End-to-end behaviour with the real engine process is in integration-tests/test_ops.py.)
"""

import asyncio

from scripted_engine import ScriptedEngine

from tgi_compat.api.server.health_monitor import EngineHealthMonitor, HealthMonitorConfig

FAST = dict(check_interval_s=0.02, check_timeout_s=0.05, liveness_interval_s=0.01, failure_threshold=3)


async def wait_until(predicate, timeout=3.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_healthy_engine_is_left_alone():
    engine = ScriptedEngine(health=["ok"], can_restart=True)
    monitor = EngineHealthMonitor(engine, HealthMonitorConfig(**FAST), on_fatal=lambda r: None)
    monitor.start()
    await wait_until(lambda: engine.num_health_checks >= 3)
    await monitor.stop()
    assert monitor.healthy and engine.num_restarts == 0


async def test_dead_process_is_restarted_at_once():
    engine = ScriptedEngine(health=["ok"], can_restart=True)
    monitor = EngineHealthMonitor(
        engine, HealthMonitorConfig(**{**FAST, "check_interval_s": 60}), on_fatal=lambda r: None
    )
    monitor.start()
    engine.alive = False
    await wait_until(lambda: monitor.restarts == 1)
    await monitor.stop()
    assert engine.num_restarts == 1 and monitor.healthy


async def test_hung_steps_restart_after_the_threshold():
    engine = ScriptedEngine(health=["ok", "hang", "fail", "hang", "ok"], can_restart=True)
    monitor = EngineHealthMonitor(engine, HealthMonitorConfig(**FAST), on_fatal=lambda r: None)
    monitor.start()
    await wait_until(lambda: not monitor.healthy)
    await wait_until(lambda: monitor.restarts == 1)
    await monitor.stop()
    assert engine.num_restarts == 1 and monitor.healthy and monitor.consecutive_failures == 0


async def test_one_miss_below_the_threshold_recovers_without_restart():
    engine = ScriptedEngine(health=["fail", "ok"], can_restart=True)
    monitor = EngineHealthMonitor(engine, HealthMonitorConfig(**FAST), on_fatal=lambda r: None)
    monitor.start()
    await wait_until(lambda: engine.num_health_checks >= 3)
    await monitor.stop()
    assert engine.num_restarts == 0 and monitor.healthy


async def test_without_restart_a_dead_engine_stops_the_server():
    reasons = []
    engine = ScriptedEngine(health=["ok"])
    monitor = EngineHealthMonitor(engine, HealthMonitorConfig(**FAST), on_fatal=reasons.append)
    task = monitor.start()
    engine.alive = False
    await asyncio.wait_for(task, 3)  # the monitor ends after giving up
    assert reasons == ["the engine process died"] and not monitor.healthy


async def test_failed_restart_is_fatal():
    reasons = []
    engine = ScriptedEngine(health=["dead"], can_restart=True, restart_ok=False)
    monitor = EngineHealthMonitor(engine, HealthMonitorConfig(**FAST), on_fatal=reasons.append)
    await asyncio.wait_for(monitor.start(), 3)
    assert engine.num_restarts == 1
    assert reasons and "restart failed: model failed to load" in reasons[0]
