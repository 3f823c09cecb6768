"""POST /vertex (Vertex AI's prediction shape, served by TGI's image):

    {"instances": [{"inputs": str, "parameters"?: {...}} | ChatRequest, ...]} -> {"predictions": [text, ...]}

As TGI does it: a generate instance samples (`do_sample=true`) with only `max_new_tokens` and `seed`
taken from its parameters; a chat instance goes through the chat mapping (template, response_format,
tools; the generated text is returned as it is). Instances run concurrently. No instances -> 422
`Input validation error`; a chat mapping error is returned as it is; any generation failure -> 500
`Incomplete generation`.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from tgi_compat.protocol.errors import BodyRejection, TgiError, is_json_content_type, read_body, syntax_message
from tgi_compat.protocol.openai import ChatRequest
from tgi_compat.protocol.tgi import GenerateParameters, GrammarType
from tgi_compat.server.auth import require_api_key
from tgi_compat.server.state import AppState, get_state
from tgi_compat.serving import accounting
from tgi_compat.serving.chat_request import chat_parameters, chat_template, render_prompt
from tgi_compat.serving.frame import validate_request
from tgi_compat.serving.generation import Timings, generate_to_end
from tgi_compat.serving.grammar import ResponseFormat

router = APIRouter()
_REJECTED = "Failed to deserialize the JSON body into the target type: "


class GenerateVertexInstance(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    inputs: str
    parameters: GenerateParameters | None = None


class _Job:
    """One instance made into a generate request's inputs."""

    def __init__(
        self,
        inputs: str,
        params: GenerateParameters,
        add_special_tokens: bool,
        grammar: GrammarType | ResponseFormat | None = None,
    ) -> None:
        self.inputs, self.params, self.add_special_tokens, self.grammar = inputs, params, add_special_tokens, grammar


def _instances(raw: bytes) -> list[Any]:
    try:
        document = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise BodyRejection(400, f"Failed to parse the request body as JSON: {syntax_message(error)}") from None
    if not isinstance(document, dict) or "instances" not in document:
        raise BodyRejection(422, _REJECTED + "missing field `instances`")
    if not isinstance(document["instances"], list):
        raise BodyRejection(422, _REJECTED + "instances: invalid type: expected a sequence")
    instances = []
    for instance in document["instances"]:
        for model in (GenerateVertexInstance, ChatRequest):  # serde's untagged order
            try:
                instances.append(model.model_validate(instance, strict=True))
                break
            except ValidationError:
                continue
        else:
            raise BodyRejection(
                422, _REJECTED + "instances: data did not match any variant of untagged enum VertexInstance"
            )
    return instances


def _job(request: Request, instance: GenerateVertexInstance | ChatRequest) -> _Job:
    if isinstance(instance, GenerateVertexInstance):
        given = instance.parameters
        params = GenerateParameters(
            do_sample=True,
            max_new_tokens=given.max_new_tokens if given is not None else None,
            seed=given.seed if given is not None else None,
            details=True,
            decoder_input_details=True,
        )
        return _Job(instance.inputs, params, add_special_tokens=True)
    prompt = render_prompt(chat_template(request), instance)  # TgiError: returned as it is
    return _Job(prompt.text, chat_parameters(instance), add_special_tokens=False, grammar=prompt.grammar)


async def _generate(state: AppState, job: _Job) -> str:
    timings = Timings(arrival=time.perf_counter())
    with state.permits.hold(1), accounting.inflight(state) as inflight:
        request = await validate_request(
            state, job.inputs, job.params, add_special_tokens=job.add_special_tokens, grammar=job.grammar
        )
        first_token = inflight.first_token if inflight is not None else None
        result = await generate_to_end(state, request, timings, first_token)
    accounting.succeeded(state, request, result, timings)
    return result.generated_text


@router.post("/vertex", dependencies=[Depends(require_api_key)], summary="Generate tokens from Vertex request")
async def vertex_compatibility(request: Request) -> Response:
    state = get_state(request)
    if not is_json_content_type(request.headers.get("content-type")):
        raise BodyRejection(415, "Expected request with `Content-Type: application/json`")
    instances = _instances(await read_body(request, state.config.payload_limit))
    accounting.received(state)
    if not instances:
        return JSONResponse({"error": "Input validation error", "error_type": "Input validation error"}, 422)
    try:
        jobs = [_job(request, instance) for instance in instances]
    except TgiError as error:
        accounting.failed(state, error)
        return error.response()
    results = await asyncio.gather(*(_generate(state, job) for job in jobs), return_exceptions=True)
    for result in results:
        if isinstance(result, TgiError):
            accounting.failed(state, result)
        elif isinstance(result, BaseException):
            raise result
    if any(isinstance(result, BaseException) for result in results):
        return JSONResponse({"error": "Incomplete generation", "error_type": "Incomplete generation"}, 500)
    return JSONResponse({"predictions": results})
