"""LoRA on a built model: slot buffers beside every adapted projection, the adapters held in host memory, and
each step's segments.

The router owns slot numbers (which adapter sits in which of the --max-loras slots, tgi_compat.router.lora_slots);
this side owns the tensors: a step's ForwardBatch.lora names the adapters to copy into their new slots and
each request's slot, and begin_step turns that into the step's LoraStep.
"""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from tgi_compat.modeling.forward_batch import ForwardBatch
from tgi_compat.modeling.layers.linear import Linear
from tgi_compat.modeling.lora.adapter import FUSED_PROJECTIONS, LoraAdapterError, LoraModule, PeftAdapter
from tgi_compat.modeling.lora.layer_ops import LoraContext, lora_layer_ops
from tgi_compat.modeling.lora.placement import HostPool, SlotPlacer, Staged, packed_nbytes
from tgi_compat.modeling.lora.step import build_lora_step, lora_step
from tgi_compat.modeling.lora.weights import LoraWeights
from tgi_compat.modeling.models.base import CausalLM
from tgi_compat.modeling.models.decoder import DecoderForCausalLM
from tgi_compat.modeling.models.llama import LlamaMLP
from tgi_compat.modeling.parallel.step_broadcast import AdapterDrop, AdapterLoad

HOST_POOL_BYTES = 8 << 30  # the most host memory page-locked up front for staged adapters
# each adapted Linear of a layer -> the checkpoint projections it holds (q|k|v and gate|up fused, as a Phi-3 has them)
_GROUPS = FUSED_PROJECTIONS | {"o_proj": ("o_proj",), "down_proj": ("down_proj",)}


@dataclass(frozen=True, slots=True)
class StagedAdapter:
    """An adapter checked against the model and cut into its slot buffers' shapes in host memory."""

    name: str
    source: str
    tensors: Staged  # each slot buffer with its host copy of this adapter
    revision: str | None = None
    entry: int | None = None  # the HostPool entry its tensors are packed into (None: a buffer of their own)


class AdapterFollowers(Protocol):
    """The other tensor-parallel ranks, as rank 0 tells them of its adapters (StepBroadcast)."""

    def send_adapter(self, load: AdapterLoad) -> None: ...

    def send_adapter_drop(self, drop: AdapterDrop) -> None: ...


class LoraManager:
    def __init__(self, model: CausalLM, max_loras: int, max_rank: int, host_entries: int = 0) -> None:
        """host_entries: adapters staged in host memory at once (--max-cpu-loras; at least max_loras)."""
        if not isinstance(model, DecoderForCausalLM):
            raise ValueError(f"LoRA adapters need a native model family; {type(model).__name__} is not one")
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.context = LoraContext()
        self.adapters: dict[int, StagedAdapter] = {}  # adapter id -> its host copy
        # tensor parallelism: rank 0 tells the other ranks of each adapter it installs or removes (`followers`);
        # they read theirs in a thread (`follow`), which the first step that copies it waits for
        self.followers: AdapterFollowers | None = None
        self._reading: dict[int, Future[StagedAdapter]] = {}
        self._reader: ThreadPoolExecutor | None = None
        self.targets: dict[Linear, LoraWeights] = {}
        # per layer: projection name (q_proj, ...) -> the weights that hold it
        self.layers: list[dict[str, LoraWeights]] = []
        layers = list(model.model.decoder_layers)
        ops = lora_layer_ops(layers[0].ops, self.context, self.targets)
        for layer in layers:
            groups = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj}
            layer.ops = layer.self_attn.ops = ops
            if isinstance(layer.mlp, LlamaMLP):  # other feed-forwards (GeGLU, experts) take no LoRA
                groups |= {"gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj}
                layer.mlp.ops = ops
            by_projection: dict[str, LoraWeights] = {}
            for group, proj in groups.items():
                names = _GROUPS[group]
                self.targets[proj] = weights = LoraWeights(proj, names, max_loras, max_rank)
                by_projection |= dict.fromkeys(names, weights)
            self.layers.append(by_projection)
        device = next(iter(self.targets.values())).a.device
        self._placer = SlotPlacer(device)
        nbytes = packed_nbytes(tensor for weights in self.targets.values() for tensor in weights.slot_buffers(0))
        # the adapters of every slot, then as many more as host_entries asks and HOST_POOL_BYTES holds (beyond, a
        # load page-locks its own memory while it is read)
        within = HOST_POOL_BYTES // nbytes
        self._pool = HostPool(nbytes, max(max_loras, min(host_entries, within)), device)
        self._copied: dict[int, torch.cuda.Event | None] = {}  # adapter id -> the event after its last slot copy

    def add(self, adapter_id: int, adapter: PeftAdapter) -> None:
        self.install(adapter_id, self.prepare(adapter))

    def prepare(self, adapter: PeftAdapter, revision: str | None = None) -> StagedAdapter:
        """Check an adapter against the model (LoraAdapterError) and stage it in (pinned) host memory. Reads no
        state a step changes: a load's reader thread calls it while steps run."""
        by_layer = _by_layer(adapter)
        for layer, modules in by_layer.items():
            if layer >= len(self.layers):
                raise LoraAdapterError(
                    f"LoRA adapter {adapter.name!r} has layer {layer}; the model has {len(self.layers)}"
                )
            _cut_fused(adapter.name, layer, modules, self.layers[layer])
            unsupported = set(modules) - set(self.layers[layer])
            if unsupported:
                raise LoraAdapterError(
                    f"LoRA adapter {adapter.name!r}: this model family takes no LoRA on {', '.join(sorted(unsupported))}"
                )
            for weights in dict.fromkeys(self.layers[layer].values()):
                weights.check(adapter.name, layer, modules)
        tensors = [
            (weights, weights.stage(by_layer.get(layer, {})))
            for layer, weights_by_projection in enumerate(self.layers)
            for weights in dict.fromkeys(weights_by_projection.values())
        ]
        packed, entry = self._pool.stage(tensors)
        return StagedAdapter(adapter.name, adapter.source, packed, revision, entry)

    def install(self, adapter_id: int, adapter: StagedAdapter) -> None:
        self.adapters[adapter_id] = adapter
        if self.followers is not None:
            self.followers.send_adapter(AdapterLoad(adapter_id, adapter.name, adapter.source, adapter.revision))

    def remove(self, adapter_id: int) -> None:
        self.release(self.adapters.pop(adapter_id, None), self._copied.pop(adapter_id, None))
        if self.followers is not None:
            self.followers.send_adapter_drop(AdapterDrop(adapter_id))

    def follow(self, message: AdapterLoad | AdapterDrop) -> None:
        """Ranks > 0: rank 0 installed (read this rank's cut in a thread) or removed an adapter."""
        if isinstance(message, AdapterDrop):
            reading = self._reading.pop(message.adapter_id, None)
            if reading is not None:  # its host entry back once the read is done
                reading.add_done_callback(self._release_read)
            self.release(self.adapters.pop(message.adapter_id, None), self._copied.pop(message.adapter_id, None))
            return
        from tgi_compat.modeling.lora.adapter import load_peft_adapter

        def read() -> StagedAdapter:
            return self.prepare(load_peft_adapter(message.name, message.source, message.revision), message.revision)

        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="lora-reader")
        self._reading[message.adapter_id] = self._reader.submit(read)

    @property
    def free_host_entries(self) -> int:
        return self._pool.num_free

    def release(self, adapter: StagedAdapter | None, copied: torch.cuda.Event | None = None) -> None:
        """An adapter's host copy is no longer needed (dropped, or read and then refused): its pool entry back, to be
        reused once `copied` (the event after its last slot copy) has passed."""
        if adapter is not None and adapter.entry is not None:
            self._pool.give_back(adapter.entry, copied)

    def _release_read(self, done: Future[StagedAdapter]) -> None:
        if not done.cancelled() and done.exception() is None:
            self.release(done.result())

    def _staged(self, adapter_id: int) -> StagedAdapter:
        reading = self._reading.pop(adapter_id, None)
        if reading is not None:  # a rank > 0's read (rank 0 read the same files: an error here is fatal)
            self.adapters[adapter_id] = reading.result()
        return self.adapters[adapter_id]

    def begin_step(self, batch: ForwardBatch, replayed: bool = False) -> None:
        """Copy the adapters newly placed in a slot (into the slot buffers in place: captured graphs keep reading
        them; on a side stream, tgi_compat.modeling.lora.placement), then set the step's segments: None without a LoRA row, or when a CUDA graph replays the step (the
        graph builds its own from its static slot input)."""
        if batch.lora is None:
            self.context.step = None
            return
        for slot, adapter_id in batch.lora.loads:
            self._copied[adapter_id] = self._placer.place(slot, self._staged(adapter_id).tensors)
        self.context.step = None if replayed else build_lora_step(batch, batch.lora.slots, self.max_loras)

    def set_decode_slots(self, slots: torch.Tensor | None) -> None:
        """For the decode CUDA graphs' capture: the step's segments built from a static [N] slot tensor (each
        row's slot, -1 for base and padding rows), so that the captured graph rebuilds them at every replay;
        None: a plain step."""
        self.context.step = None if slots is None else lora_step(slots, self.max_loras)


def _cut_fused(name: str, layer: int, modules: dict[str, LoraModule], weights: dict[str, LoraWeights]) -> None:
    """A fused checkpoint's pair (Phi-3's qkv_proj, gate_up_proj) as one pair per part, in place: each part reads
    the same A and its rows of B, by the model's output size of each part."""
    for fused, parts in FUSED_PROJECTIONS.items():
        module = modules.pop(fused, None)
        if module is None:
            continue
        where = f"LoRA adapter {name!r}: layers.{layer}.{fused}"
        if parts[0] not in weights:
            raise LoraAdapterError(f"{where}: this model family takes no LoRA on {', '.join(parts)}")
        if twice := [part for part in parts if part in modules]:
            raise LoraAdapterError(f"{where} and {', '.join(twice)} both adapt the same weights")
        sizes = {part.projection: part.full_out for part in weights[parts[0]].slices}
        if module.b.shape[0] != sum(sizes[part] for part in parts):
            raise LoraAdapterError(
                f"{where} has {module.b.shape[0]} outputs, the model's {' | '.join(parts)} "
                f"{sum(sizes[part] for part in parts)} (an adapter for another base model?)"
            )
        for part, b in zip(parts, module.b.split([sizes[part] for part in parts]), strict=True):
            modules[part] = LoraModule(module.a, b)


def _by_layer(adapter: PeftAdapter) -> dict[int, dict[str, LoraModule]]:
    layers: dict[int, dict[str, LoraModule]] = defaultdict(dict)
    for (layer, projection), module in adapter.modules.items():
        layers[layer][projection] = module
    return layers
