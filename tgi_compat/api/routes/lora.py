"""vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (tgi_compat/api/serving/lora_adapters.py answers);
included only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, behind the API key."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tgi_compat.api.routes.auth import guarded_post
from tgi_compat.api.serving import lora_adapters
from tgi_compat.api.serving.state import get_state

router = APIRouter()


@guarded_post(router, "/v1/load_lora_adapter", "Load a LoRA adapter (vLLM)")
async def load_lora_adapter(request: Request) -> Response:
    body = await request.body()
    return await lora_adapters.load_adapter(get_state(request), body, request.headers.get("content-type"))


@guarded_post(router, "/v1/unload_lora_adapter", "Unload a LoRA adapter (vLLM)")
async def unload_lora_adapter(request: Request) -> Response:
    body = await request.body()
    return await lora_adapters.unload_adapter(get_state(request), body, request.headers.get("content-type"))
