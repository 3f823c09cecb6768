"""The background helpers a server runs beside uvicorn, started from its config in one call.

    services = start_ops_services(state.metrics, config)   # after the state is built
    ...
    services.stop()                                        # after the drain (final push)

* LightLLM's `--metric_gateway` (+ `--job_name`, `--grouping_key`, `--push_interval`,
  `--enable_monitor_auth`): a MetricsPusher thread.
* LightLLM's periodic stats line (`--log_stats_interval`, off with `--disable_log_stats`).

Config fields read (ServerConfig names, as tgi_compat.api.cli.lightllm_args maps LightLLM's flags):
metric_gateway, metric_job_name, metric_grouping_key, metric_push_interval, enable_monitor_auth,
disable_log_stats, log_stats_interval. A config without them (TGI's launcher only) starts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from tgi_compat.api.config import ServerConfig
from tgi_compat.api.observability.logging_setup import StatsLogger
from tgi_compat.api.observability.metrics import ServerMetrics
from tgi_compat.api.observability.metrics_push import MetricsPusher, PushGatewayConfig


@dataclass
class OpsServices:
    pusher: MetricsPusher | None = None
    stats_logger: StatsLogger | None = None

    def stop(self) -> None:
        if self.stats_logger is not None:
            self.stats_logger.stop()
        if self.pusher is not None:
            self.pusher.stop(final_push=True)


def start_ops_services(metrics: ServerMetrics, config: ServerConfig) -> OpsServices:
    services = OpsServices()
    if config.metric_gateway:
        push_config = PushGatewayConfig.from_flags(
            config.metric_gateway,
            job_name=config.metric_job_name or "lightllm",
            grouping_key=config.metric_grouping_key or (),
            push_interval=config.metric_push_interval or 10,
            enable_monitor_auth=config.enable_monitor_auth,
        )
        services.pusher = MetricsPusher(metrics, push_config).start()
    interval = config.log_stats_interval
    if interval and not config.disable_log_stats:
        services.stats_logger = StatsLogger(metrics, float(interval)).start()
    return services
