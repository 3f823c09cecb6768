"""LoRA adapters loaded and unloaded while serving: the engine loop's side of LoadAdapter / UnloadAdapter.

    engine loop:  reply = calls.submit(call)        # an unload (or a refused load) is answered at once
                  ... steps ...
                  replies = calls.take_replies()    # loads whose files were read, installed between two steps

A load reads and checks its files (the disk, or the hub) and stages them in pinned host memory in a thread, so
the requests that run meanwhile never wait for it; installing it is a dictionary entry. Its tensors reach a device
slot, copied on a side stream, when a request of it is first scheduled (tgi_compat.router.lora_slots,
tgi_compat.modeling.lora.placement).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from tgi_compat.router.lora_registry import LoraRegistry
from tgi_compat.router.wire import AdapterCall, AdapterReply, LoadAdapter

if TYPE_CHECKING:
    from tgi_compat.modeling.lora.manager import StagedAdapter

logger = logging.getLogger(__name__)
LORA_OFF = "LoRA is off: start the server with --enable-lora (or --lora-adapters, --lora-modules)"


class AdapterCalls:
    def __init__(self, registry: LoraRegistry | None) -> None:
        self.registry = registry
        self._reading: list[tuple[LoadAdapter, Future[StagedAdapter]]] = []
        self._reader: ThreadPoolExecutor | None = None  # one thread, started by the first load

    @property
    def num_reading(self) -> int:
        return len(self._reading)

    def submit(self, call: AdapterCall) -> AdapterReply | None:
        """Start a call: its reply now (an unload, a refusal), or None for a load whose files are being read."""
        registry = self.registry
        if registry is None:
            return AdapterReply(call.call_id, {}, LORA_OFF)
        if not isinstance(call, LoadAdapter):
            try:
                registry.unload(call.name)
            except LookupError as exc:
                return self._reply(call, str(exc), not_found=True)
            logger.info("unloaded LoRA adapter %r", call.name)
            return self._reply(call)
        try:
            registry.check_room(call.name, call.replace)
        except ValueError as exc:
            return self._reply(call, str(exc))
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="lora-reader")
        self._reading.append((call, self._reader.submit(registry.read, call.name, call.source)))
        return None

    def take_replies(self) -> list[AdapterReply]:
        """Install the loads whose files are read (between two steps); their replies."""
        if not self._reading:
            return []
        from tgi_compat.modeling.lora.adapter import LoraAdapterNotFoundError

        replies, still_reading = [], []
        for call, future in self._reading:
            if not future.done():
                still_reading.append((call, future))
                continue
            assert self.registry is not None  # a load is only read with LoRA on
            try:
                self.registry.install(call.name, future.result(), call.replace)
            except ValueError as exc:  # LoraAdapterError included: the reason, nothing changed
                replies.append(self._reply(call, str(exc), not_found=isinstance(exc, LoraAdapterNotFoundError)))
            except OSError as exc:  # an unreadable file
                replies.append(self._reply(call, f"LoRA adapter {call.name!r}: {exc}"))
            else:
                logger.info("loaded LoRA adapter %r from %s", call.name, call.source)
                replies.append(self._reply(call))
        self._reading = still_reading
        return replies

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)

    def _reply(self, call: AdapterCall, error: str | None = None, not_found: bool = False) -> AdapterReply:
        assert self.registry is not None
        return AdapterReply(call.call_id, dict(self.registry.sources), error, not_found)
