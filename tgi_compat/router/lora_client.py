"""The API side of LoRA loads and unloads while serving: calls awaiting the engine's AdapterReply.

EngineClient.load_adapter(name, source) -> LoadAdapter --> engine loop (tgi_compat.router.lora_calls)
                                        <-- AdapterReply (the error, if any; the adapters loaded now)
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from tgi_compat.router.client_api import AdapterCallError
from tgi_compat.router.wire import AdapterCall, AdapterReply

_call_ids = itertools.count()


class PendingAdapterCalls:
    def __init__(self, adapters: dict[str, str]) -> None:
        self.adapters = adapters  # name -> source, as of the engine's last reply
        self._waiting: dict[int, asyncio.Future[AdapterReply]] = {}

    @staticmethod
    def next_id() -> int:
        return next(_call_ids)

    async def call(self, call: AdapterCall, submit: Callable[[AdapterCall], None]) -> None:
        """Send a call and wait for its reply (AdapterCallError: the reason; EngineDeadError)."""
        waiting = self._waiting[call.call_id] = asyncio.get_running_loop().create_future()
        try:
            submit(call)
            reply = await waiting
        finally:
            self._waiting.pop(call.call_id, None)
        if reply.error is not None:
            raise AdapterCallError(reply.error, reply.not_found)

    def on_reply(self, reply: AdapterReply) -> None:
        self.adapters = reply.adapters  # replies arrive in the engine's order: the last one is current
        if (waiting := self._waiting.get(reply.call_id)) is not None and not waiting.done():
            waiting.set_result(reply)

    def fail(self, error: BaseException) -> None:
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_exception(error)
