"""Startup and shutdown: tokenizer + engine subprocess + warmup, then (only then) bind the port.

Like TGI, the HTTP port refuses connections until the model is loaded and has run a real step,
so "connection refused" means "not ready yet" and the first accepted request is fast.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

import uvicorn

from tgi_compat.api.config import ServerConfig, ServingLimits
from tgi_compat.api.observability.metrics_listener import start_prometheus_listener
from tgi_compat.api.observability.tracing import RequestTracer
from tgi_compat.api.server.app import create_app
from tgi_compat.api.server.graceful import GracefulShutdown
from tgi_compat.api.server.health_monitor import EngineHealthMonitor, HealthMonitorConfig
from tgi_compat.api.server.http_protocol import bounded_head_protocol
from tgi_compat.api.server.ops_services import start_ops_services
from tgi_compat.api.server.warmup import GPU_BATCH, warm_up, warm_up_images
from tgi_compat.api.serving.image_fetch import ImageFetcher
from tgi_compat.api.serving.images import VisionPrompts
from tgi_compat.api.serving.state import AppState
from tgi_compat.api.serving.tokenization import load_tokenizer_service
from tgi_compat.modeling.registry import UnsupportedArchitectureError, describe_modeling_path
from tgi_compat.router.client_api import EngineClient, EngineDeadError
from tgi_compat.router.engine_process import freeze_startup_heap

logger = logging.getLogger("tgi_compat.api.server")

ENGINE_WATCH_SECONDS = 1.0


async def start_engine(config: ServerConfig) -> EngineClient:
    """The engine in a subprocess (or in this process with `engine_in_process`), model loaded."""
    from tgi_compat.router.client import ZmqEngineClient
    from tgi_compat.router.client_in_process import InProcessEngineClient

    client_class = InProcessEngineClient if config.engine_in_process else ZmqEngineClient
    return await client_class.start(config.to_engine_config())


def _modeling_path(architecture: str) -> str:
    try:
        return describe_modeling_path(architecture)
    except UnsupportedArchitectureError:  # an engine stand-in (tests, benchmarks) with no real model
        return "no modeling"


async def build_state(config: ServerConfig) -> AppState:
    started = time.perf_counter()
    tokenizer_task = asyncio.create_task(
        asyncio.to_thread(load_tokenizer_service, config.model_id, config.revision, config.validation_workers)
    )
    engine = await start_engine(config)
    tokenizer = await tokenizer_task
    limits = ServingLimits.resolve(config, engine.info.max_total_tokens)
    await warm_up(  # before the port opens: TGI warms its shards the same way
        engine,
        tokenizer.encode_sync("The quick brown fox jumps over the lazy dog.") or [0],
        limits.max_input_tokens,
        limits.max_total_tokens,
        config.max_batch_size or GPU_BATCH,
    )
    vision = _vision_prompts(config)
    if vision is not None:
        await warm_up_images(engine, vision, tokenizer, limits.max_input_tokens, config.max_batch_size or GPU_BATCH)
    logger.info(
        "Ready in %.1f s: %s on %s (%s), max_total_tokens=%d, max_input_tokens=%d, KV slots=%d",
        time.perf_counter() - started,
        config.model_id,
        engine.info.device,
        engine.info.dtype,
        limits.max_total_tokens,
        limits.max_input_tokens,
        engine.info.num_kv_slots,
    )
    # TGI's /info has no field for it, so the log says which modeling path serves the model
    logger.info("Model %s: %s", engine.info.architecture, _modeling_path(engine.info.architecture))
    state = AppState.over_engine(
        config,
        engine,
        tokenizer,
        compute_type=os.environ.get("COMPUTE_TYPE", "gpu+optimized"),
        tracer=RequestTracer(config.otlp_endpoint, config.otlp_service_name) if config.otlp_endpoint else None,
        vision=vision,
    )
    engine.stats_listener = state.metrics.apply_engine_stats  # batch/queue/KV gauges and step timings
    return state


def _vision_prompts(config: ServerConfig) -> VisionPrompts | None:
    from tgi_compat.modeling.source import resolve_model_source
    from tgi_compat.modeling.weights.loader import load_model_config

    source = resolve_model_source(config.model_id, config.revision)
    model = load_model_config(source)
    fetcher = ImageFetcher(config.max_image_fetch_size, config.allow_private_image_urls)
    return VisionPrompts.of(model, fetcher, source.folder, config.max_images)


async def _watch_engine(state: AppState, server: uvicorn.Server) -> None:
    """A dead engine process stops the server (non-zero exit) instead of leaving clients hanging."""
    while not server.should_exit:
        await asyncio.sleep(ENGINE_WATCH_SECONDS)
        if state.engine.is_dead:
            logger.error("The engine process died; shutting down")
            server.should_exit = True
            raise EngineDeadError("engine process died")


def _start_health_monitor(state: AppState, server: uvicorn.Server, fatal: list[str]) -> EngineHealthMonitor:
    """LightLLM's --health_monitor: a dead engine, or one that makes no progress at all, is replaced;
    when the replacement fails the server stops."""

    def on_fatal(reason: str) -> None:
        fatal.append(reason)
        server.should_exit = True

    monitor = EngineHealthMonitor(state.engine, HealthMonitorConfig.from_env(restart=True), on_fatal)
    monitor.start()
    return monitor


async def run_server(config: ServerConfig) -> int:
    state = await build_state(config)
    app = create_app(state)
    freeze_startup_heap()
    graceful = GracefulShutdown(config.graceful_termination_timeout, on_expired=state.engine.shutdown)
    uvicorn_config = uvicorn.Config(
        app,
        host=config.hostname,
        port=config.port,
        http=bounded_head_protocol(config.header_read_timeout),  # httptools, with hyper's limits on request heads
        log_config=None,  # keep the handlers configure_logging installed
        access_log=False,
        lifespan="off",
        **graceful.uvicorn_options(),
    )
    server = uvicorn.Server(uvicorn_config)
    logger.info("HTTP server: uvicorn, httptools protocol, %s event loop", type(asyncio.get_running_loop()).__module__)
    # Without --health-monitor only a dead engine stops the server (TGI: a slow one never does);
    # with it the monitor restarts a dead or hung one.
    watcher = None if config.health_monitor else asyncio.create_task(_watch_engine(state, server))
    fatal: list[str] = []
    monitor = _start_health_monitor(state, server, fatal) if config.health_monitor else None
    services = start_ops_services(state.metrics, config)
    listener = start_prometheus_listener(state.metrics, config.hostname, config.prometheus_port)
    try:
        await graceful.serve(server)
    finally:
        if watcher is not None:
            watcher.cancel()
        services.stop()
        if listener is not None:
            listener.stop()
        if monitor is not None:
            await monitor.stop()
        await state.engine.shutdown()
        state.tokenizer.shutdown()
        if state.vision is not None:
            state.vision.fetcher.decoded.decoder.close()
        if state.tracer is not None:
            state.tracer.shutdown()
    engine_died = watcher is not None and watcher.done() and not watcher.cancelled() and watcher.exception() is not None
    return 1 if engine_died or fatal or not server.started else 0


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed (uvicorn[standard]'s loop: C transports and callbacks), else asyncio's.

    uvicorn picks its loop only in `uvicorn.run`; we own the loop (the engine client starts before
    the port opens), so the choice is made here; run_server picks the HTTP protocol (httptools).
    """
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def serve(config: ServerConfig) -> int:
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            return runner.run(run_server(config))
    except KeyboardInterrupt:
        return 0
    except Exception:
        logger.exception("Server failed")
        return 1
