"""The HTTP API: TGI's and OpenAI's routes and wire formats, validation, streaming, metrics and the
launchers. Imports point cli → server → routes → serving → protocol (docs/architecture.md §1)."""
