"""tgi-compat: Hugging Face TGI's API on a LightLLM-style engine.

One import root, four parts (docs/architecture.md §1): `api` (HTTP, wire formats, launchers),
`router` (the engine core), `modeling` (models, layers, the runner) and `kernels` (Triton).
"""
