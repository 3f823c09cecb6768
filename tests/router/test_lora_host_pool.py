"""Staged LoRA adapters live in a host pool made when LoRA starts (page-locked beside a GPU model, so that no load
page-locks memory while steps run): an entry per adapter up to --max-cpu-loras, given back when the adapter is
dropped or its read is refused, so that loads and unloads without end never run out of it."""

from __future__ import annotations

import time

import torch
from smollm2_cases import SMOLLM2_PROMPTS, smollm2_engine_config

from tests.lora_adapters import write_smollm2_adapter
from tgi_compat.modeling.lora.placement import HostPool, packed_nbytes
from tgi_compat.router.config import LoraSource
from tgi_compat.router.engine import EngineCore
from tgi_compat.router.request import GenerateRequest
from tgi_compat.router.wire import LoadAdapter


class Weights:  # the slot buffers' side of a staged pair: pack reads only the tensors
    pass


def staged(value: float) -> list:  # an FP8 base's three tensors: A in e4m3, B, A's row scales
    a = torch.full((2, 3), value).to(torch.float8_e4m3fn)
    return [(Weights(), (a, torch.full((4, 1), value, dtype=torch.bfloat16), torch.full((2,), value)))]


def test_the_pool_hands_out_its_entries_then_buffers_of_their_own_and_reuses_what_comes_back():
    nbytes = packed_nbytes(staged(0.0)[0][1])
    assert nbytes == 16 + 16 + 16  # each tensor from a 16-byte boundary: 6, 8 and 8 bytes
    pool = HostPool(nbytes, entries=2, device=torch.device("cpu"))
    first, second, third = (pool.stage(staged(v)) for v in (1.0, 2.0, 3.0))
    assert [entry for _, entry in (first, second, third)] == [0, 1, None] and pool.num_free == 0
    for (packed, _), value in zip((first, second, third), (1.0, 2.0, 3.0)):
        for tensor, expected in zip(packed[0][1], staged(value)[0][1], strict=True):
            assert tensor.dtype == expected.dtype and torch.equal(tensor.float(), expected.float())
    assert second[0][0][1][0].untyped_storage().data_ptr() == pool.buffer.untyped_storage().data_ptr()  # in place
    assert third[0][0][1][0].untyped_storage().data_ptr() != pool.buffer.untyped_storage().data_ptr()
    pool.give_back(0, None)
    again, entry = pool.stage(staged(4.0))
    assert entry == 0 and torch.equal(
        pool.buffer[0, 16:24].view(torch.bfloat16), torch.full((4,), 4.0, dtype=torch.bfloat16)
    )
    assert torch.equal(again[0][1][2], torch.full((2,), 4.0))


def test_loads_and_unloads_without_end_keep_every_adapter_in_the_pool(tmp_path):
    folder = write_smollm2_adapter(tmp_path / "a", 8, seed=1)
    engine = EngineCore.from_config(
        smollm2_engine_config(
            max_loras=1, max_cpu_loras=2, max_lora_rank=8, lora_adapters=[LoraSource("base-a", str(folder))]
        )
    )
    manager = engine.lora.manager
    assert manager.free_host_entries == 1
    for i in range(5):
        engine.load_adapter(f"x{i}", str(folder))
        assert manager.adapters[engine.lora.ids[f"x{i}"]].entry is not None and manager.free_host_entries == 0
        engine.add_request(GenerateRequest(f"r{i}", SMOLLM2_PROMPTS[0], max_new_tokens=2, adapter_id=f"x{i}"))
        while engine.has_unfinished():
            engine.step()
        engine.unload_adapter(f"x{i}")
        assert manager.free_host_entries == 1
    # a load read in the reader's thread and then refused (its name was taken meanwhile) gives its entry back
    calls = engine.adapter_calls
    assert calls.submit(LoadAdapter(1, "twice", str(folder))) is None
    engine.load_adapter("twice", str(folder))
    while calls.num_reading:
        time.sleep(0.01)
        replies = calls.take_replies()
    assert replies[0].error == "LoRA adapter 'twice' is already loaded"
    # the refused read's entry is back: the one left is free unless "twice" holds it (whichever read took it first)
    holds = manager.adapters[engine.lora.ids["twice"]].entry is not None
    assert manager.free_host_entries == 1 - holds
    engine.unload_adapter("twice")
    assert manager.free_host_entries == 1
    engine.close()


def test_past_the_pools_bytes_a_load_takes_memory_of_its_own_and_serves(tmp_path, monkeypatch):
    """The pool holds every slot's adapter, then what HOST_POOL_BYTES allows (here nothing more): a load past it
    stages into a buffer of its own, and its requests run as any other's."""
    from tgi_compat.modeling.lora import manager as lora_manager

    monkeypatch.setattr(lora_manager, "HOST_POOL_BYTES", 0)
    folder = write_smollm2_adapter(tmp_path / "a", 8, seed=2)
    engine = EngineCore.from_config(
        smollm2_engine_config(
            max_loras=1, max_cpu_loras=4, max_lora_rank=8, lora_adapters=[LoraSource("first", str(folder))]
        )
    )
    manager = engine.lora.manager
    assert manager.adapters[engine.lora.ids["first"]].entry == 0 and manager.free_host_entries == 0
    engine.load_adapter("second", str(folder))
    assert manager.adapters[engine.lora.ids["second"]].entry is None
    tokens = {}
    for name in ("first", "second"):
        engine.add_request(
            GenerateRequest(name, SMOLLM2_PROMPTS[0], max_new_tokens=3, ignore_eos=True, adapter_id=name)
        )
    while engine.has_unfinished():
        for event in engine.step():
            tokens.setdefault(event.request_id, []).extend(event.token_ids)
    assert tokens["first"] == tokens["second"] and len(tokens["first"]) == 3  # one adapter's files, two names
    engine.unload_adapter("second")
    assert manager.free_host_entries == 0  # (its buffer was its own)
    engine.close()
