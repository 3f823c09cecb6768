"""TGI's Vertex AI prediction shape behind POST /vertex:

    {"instances": [{"inputs": str, "parameters"?: {...}} | ChatRequest, ...]} -> {"predictions": [text, ...]}

As TGI does it: a generate instance samples (`do_sample=true`) with only `max_new_tokens` and `seed`
taken from its parameters; a chat instance goes through the chat mapping (template, response_format,
tools; the generated text is returned as it is). Instances run concurrently. No instances -> 422
`Input validation error`; a chat mapping error is returned as it is; any generation failure -> 500
`Incomplete generation`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tgi_compat.api.protocol.answers import JsonAnswer
from tgi_compat.api.protocol.errors import BodyRejection, TgiError, load_json
from tgi_compat.api.protocol.grammar import ResponseFormat
from tgi_compat.api.protocol.openai import ChatRequest
from tgi_compat.api.protocol.serde import SerdeModel
from tgi_compat.api.protocol.tgi import GenerateParameters, GrammarType
from tgi_compat.api.serving import accounting
from tgi_compat.api.serving.chat.request import TemplatedService, chat_parameters, render_prompt
from tgi_compat.api.serving.frame import RequestFrame

_REJECTED = "Failed to deserialize the JSON body into the target type: "


class GenerateVertexInstance(SerdeModel):
    inputs: str
    parameters: GenerateParameters | None = None


VertexInstance = GenerateVertexInstance | ChatRequest


def parse_instances(raw: bytes) -> list[VertexInstance]:
    """serde's reading of `{"instances": [...]}`: each instance is the first untagged variant that fits."""
    document = load_json(raw)
    if not isinstance(document, dict) or "instances" not in document:
        raise BodyRejection(422, _REJECTED + "missing field `instances`")
    if not isinstance(document["instances"], list):
        raise BodyRejection(422, _REJECTED + "instances: invalid type: expected a sequence")
    instances: list[VertexInstance] = []
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


@dataclass(slots=True)
class _Job:
    """One instance made into a generate request's inputs."""

    inputs: str
    params: GenerateParameters
    add_special_tokens: bool
    grammar: GrammarType | ResponseFormat | None = None


def _error_body(error: str) -> dict[str, Any]:
    return {"error": error, "error_type": error}


class VertexService(TemplatedService):
    async def predict(self, instances: list[VertexInstance]) -> JsonAnswer:
        """`{"predictions": [text, ...]}`, one per instance, generated concurrently."""
        state = self.state
        accounting.received(state)  # one HTTP request, however many instances
        if not instances:
            return JsonAnswer(_error_body("Input validation error"), status=422)
        try:
            jobs = [await self._job(instance) for instance in instances]
        except TgiError as error:
            accounting.failed(state, error)
            return JsonAnswer.error(error)
        results = await asyncio.gather(*(self._generate(job) for job in jobs), return_exceptions=True)
        for result in results:
            if isinstance(result, TgiError):
                accounting.failed(state, result)
            elif isinstance(result, BaseException):
                raise result
        if any(isinstance(result, BaseException) for result in results):
            return JsonAnswer(_error_body("Incomplete generation"), status=500)
        return JsonAnswer({"predictions": results})

    async def _job(self, instance: VertexInstance) -> _Job:
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
        prompt = await asyncio.to_thread(render_prompt, self.template, instance)  # Jinja: off the loop
        return _Job(prompt.text, chat_parameters(instance), add_special_tokens=False, grammar=prompt.grammar)

    async def _generate(self, job: _Job) -> str:
        frame = RequestFrame(self.state, count_received=False)
        async with frame.admit(
            job.inputs, job.params, add_special_tokens=job.add_special_tokens, grammar=job.grammar
        ) as admitted:
            result = await admitted.to_end()
        frame.succeeded(admitted.request, result)
        return result.generated_text
