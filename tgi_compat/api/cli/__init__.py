"""Command lines: the TGI launcher, LightLLM's api_server entry point, and ServerConfig."""
