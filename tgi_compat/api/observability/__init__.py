"""Metrics (TGI's and vLLM's names), the Prometheus text, metrics listener and push, tracing, logging."""
