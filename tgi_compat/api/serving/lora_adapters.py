"""vLLM's runtime LoRA routes (POST /v1/load_lora_adapter, /v1/unload_lora_adapter) and the adapters' cards in
/v1/models, over the engine client's load_adapter / unload_adapter.

As in vLLM the routes exist only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true (else a 404); success is a 200 with
a plain sentence, an error vLLM's `{"error": {"message", "type", "param", "code"}}`: 400 for a bad body, a taken
name or an adapter that cannot be served, 404 for an adapter (or a path) that does not exist.
"""

from __future__ import annotations

import json
import logging
import os
from typing import TypeVar

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from tgi_compat.api.protocol.errors import is_json_content_type
from tgi_compat.api.serving.state import AppState
from tgi_compat.router.client_api import AdapterCallError

logger = logging.getLogger(__name__)
Body = TypeVar("Body", bound=BaseModel)


def runtime_lora_updating() -> bool:
    """vLLM's switch for the routes, read when the app is built."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace the adapter of that name: its running requests finish on the old weights


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str


def error_response(message: str, status: int = 400, error_type: str = "BadRequestError") -> JSONResponse:
    body = {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


def _parse(raw: bytes, content_type: str | None, model: type[Body]) -> Body | JSONResponse:
    if not is_json_content_type(content_type):
        return error_response("Unsupported Media Type: Only 'application/json' is allowed", 415)
    try:
        return model.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as error:  # JSON syntax (ValueError) or shape
        return error_response(str(error))


async def load_adapter(state: AppState, raw: bytes, content_type: str | None) -> Response:
    body = _parse(raw, content_type, LoadLoraAdapterRequest)
    if isinstance(body, Response):
        return body
    name = body.lora_name
    if not name or not body.lora_path:
        return error_response("Both 'lora_name' and 'lora_path' must be provided.", error_type="InvalidUserInput")
    if name in state.engine.lora_adapters and not body.load_inplace:
        return error_response(f"The lora adapter '{name}' has already been loaded.", error_type="InvalidUserInput")
    try:
        await state.engine.load_adapter(name, body.lora_path, body.load_inplace)
    except AdapterCallError as error:
        return error_response(str(error), *((404, "NotFoundError") if error.not_found else ()))
    state.metrics.set_lora_count(len(state.engine.lora_adapters))
    logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, body.lora_path)
    return Response(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_adapter(state: AppState, raw: bytes, content_type: str | None) -> Response:
    body = _parse(raw, content_type, UnloadLoraAdapterRequest)
    if isinstance(body, Response):
        return body
    name = body.lora_name
    if not name:
        return error_response(
            "'lora_name' needs to be provided to unload a LoRA adapter.", error_type="InvalidUserInput"
        )
    try:
        await state.engine.unload_adapter(name)
    except AdapterCallError as error:
        if not error.not_found:
            return error_response(str(error))
        return error_response(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError")
    state.metrics.set_lora_count(len(state.engine.lora_adapters))
    state.metrics.adapter_unloaded(name)
    logger.info("Removed LoRA adapter: name '%s'", name)
    return Response(f"Success: LoRA adapter '{name}' removed successfully.")


def adapter_cards(state: AppState) -> list[dict]:
    """/v1/models entries of the loaded adapters, as vLLM lists them: `root` the adapter's path, `parent` the base."""
    parent = state.served_model_name
    return [
        {"id": name, "object": "model", "created": 0, "owned_by": parent, "root": source, "parent": parent}
        for name, source in state.engine.lora_adapters.items()
    ]
