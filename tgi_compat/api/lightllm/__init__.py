"""LightLLM compatibility: its server flags mapped onto ServerConfig, and its per-request features."""
