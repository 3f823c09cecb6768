"""The engine's LoRA adapters by name: loaded at startup or while serving, unloaded, and resolved per request.

Each load gets a new id (never reused), which tags the request's prefix-cache keys and names the adapter to
the runner: an adapter unloaded and loaded again under the same name never meets the old one's K/V or weights.
An unloaded adapter's host copy stays while requests of it are still in the engine. A load that replaces one
(vLLM's `load_inplace`) is the two at once: new requests of the name get the new weights, the ones already in the
engine finish on the weights they started with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tgi_compat.router.client_api import Refusal, RequestRejectedError
from tgi_compat.router.lora_slots import LoraSlots

if TYPE_CHECKING:
    from tgi_compat.modeling.lora.manager import LoraManager, StagedAdapter


FIRST_ADAPTER_ID = 1  # ids count up from here (the other tensor-parallel ranks number the startup adapters alike)


class LoraRegistry:
    def __init__(self, manager: LoraManager, max_cpu_loras: int, in_use: Callable[[int], bool]) -> None:
        self.manager = manager
        self.slots = LoraSlots(manager.max_loras)
        self.max_cpu_loras = max_cpu_loras
        self.in_use = in_use  # whether a request of this adapter id is still in the engine
        self.ids: dict[str, int] = {}  # name -> id of the loaded adapters
        self.sources: dict[str, str] = {}  # name -> the folder or hub id it was loaded from
        self._names: dict[int, str] = {}  # id -> name of the loaded and the retired adapters
        self._retired: list[int] = []  # unloaded, with requests left
        self._next_id = FIRST_ADAPTER_ID

    @property
    def names(self) -> list[str]:
        return list(self.ids)

    def load(self, name: str, source: str, revision: str | None = None, replace: bool = False) -> None:
        """Read, check and keep an adapter (LoraAdapterError, ValueError for a taken name or a full host cache);
        with `replace`, in place of the one of that name if there is one."""
        self.check_room(name, replace)
        self.install(name, self.read(name, source, revision), replace)

    def read(self, name: str, source: str, revision: str | None = None) -> StagedAdapter:
        """Read an adapter's files, check it against the model and stage it in host memory (LoraAdapterError):
        all the slow part of a load, safe in a thread while steps run."""
        from tgi_compat.modeling.lora.adapter import load_peft_adapter

        return self.manager.prepare(load_peft_adapter(name, source, revision), revision)

    def check_room(self, name: str, replace: bool = False) -> None:
        """ValueError when `name` is taken (unless replaced) or the host cache (--max-cpu-loras) is full."""
        replaced = self.ids.get(name)
        if replaced is not None and not replace:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        self._drop_retired()
        held = len(self.ids) + len(self._retired)
        if replaced is not None and not self.in_use(replaced):
            held -= 1  # its host copy goes as the new one comes
        if held >= self.max_cpu_loras:
            raise ValueError(f"{self.max_cpu_loras} LoRA adapters are loaded (--max-cpu-loras): unload one first")

    def install(self, name: str, adapter: StagedAdapter, replace: bool = False) -> None:
        """Keep an adapter `read` (ValueError: the name was taken, or the host cache filled, meanwhile)."""
        try:
            self.check_room(name, replace)  # again: a load read in a thread may meet another of the same name
        except ValueError:
            self.manager.release(adapter)
            raise
        if name in self.ids:  # replaced: retired first, so that the host cache never holds one too many
            self.unload(name)
        adapter_id, self._next_id = self._next_id, self._next_id + 1
        self.manager.install(adapter_id, adapter)
        self.ids[name] = adapter_id
        self.sources[name] = adapter.source
        self._names[adapter_id] = name

    def unload(self, name: str) -> None:
        adapter_id = self.ids.pop(name, None)
        if adapter_id is None:
            raise LookupError(f"LoRA adapter {name!r} is not loaded{self._loaded_list()}")
        del self.sources[name]
        self._retired.append(adapter_id)
        self._drop_retired()

    def name_of(self, adapter_id: int) -> str:
        return self._names[adapter_id]

    def resolve(self, name: str) -> int:
        adapter_id = self.ids.get(name)
        if adapter_id is None:
            raise RequestRejectedError(Refusal.UNKNOWN_ADAPTER, name, *self.ids)
        return adapter_id

    def _loaded_list(self) -> str:
        return f"; loaded: {', '.join(self.ids)}" if self.ids else "; no adapter is loaded"

    def _drop_retired(self) -> None:
        for adapter_id in [i for i in self._retired if not self.in_use(i)]:
            self._retired.remove(adapter_id)
            del self._names[adapter_id]
            self.manager.remove(adapter_id)
            self.slots.forget(adapter_id)
