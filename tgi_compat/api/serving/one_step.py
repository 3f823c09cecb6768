"""One engine request that ends at its first event (a pooling prompt, a beam step's single token): its final
event, with the engine's failures as TGI's errors."""

from __future__ import annotations

from contextlib import aclosing

from tgi_compat.api.protocol.errors import generation_error, incomplete_generation_error
from tgi_compat.api.serving.validation import engine_refusal
from tgi_compat.router.client_api import EngineClient, EngineDeadError, RequestRejectedError
from tgi_compat.router.outputs import TokenEvent
from tgi_compat.router.request import GenerateRequest


async def final_event(engine: EngineClient, request: GenerateRequest) -> TokenEvent:
    try:
        async with aclosing(engine.generate(request)) as events:
            async for event in events:
                if event.error is not None:
                    raise generation_error(event.error)
                if event.finish_reason is not None:
                    return event
    except EngineDeadError as error:
        raise generation_error(str(error) or "engine is not running") from error
    except RequestRejectedError as error:
        raise engine_refusal(error) from error
    raise incomplete_generation_error(False)
