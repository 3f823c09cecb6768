"""LoRA decode steps as the CUDA graphs record them, run eagerly on the CPU: the graph's own segment build (from
its static slot input, padding rows -1) gives the eager LoRA step's logits, and the plain graph the base step's.
The capture and replay themselves: tests/gpu/test_lora_gpu.py."""

from __future__ import annotations

import pytest
import torch

from tests.lora_adapters import write_smollm2_adapter
from tgi_compat.modeling.cuda_graphs import DecodeCudaGraphs
from tgi_compat.modeling.forward_batch import LoraBatch, build_forward_batch
from tgi_compat.modeling.lora.adapter import load_peft_adapter
from tgi_compat.modeling.lora.step import lora_step
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

PROMPTS = [[1, 9690, 314, 253, 2087], [1, 504, 3458, 282], [1, 1350, 30, 2492], [1, 9690, 314], [1, 28, 29]]
SLOTS = [-1, 0, 2, 0, -1]  # base rows between two adapters' rows; slot 1 idle


@pytest.mark.parametrize("seed", range(6))
def test_counting_sort_equals_a_stable_argsort(seed):
    generator = torch.Generator().manual_seed(seed)
    max_loras = 1 + seed
    slots = torch.randint(-1, max_loras, (1 + 37 * seed,), generator=generator)
    step = lora_step(slots, max_loras)
    keys = torch.where(slots < 0, max_loras, slots)
    assert torch.equal(step.token_order, torch.argsort(keys, stable=True))
    counts = torch.bincount(keys, minlength=max_loras + 1)[:max_loras]
    assert torch.equal(step.seg_len, counts)
    assert torch.equal(step.seg_start, torch.cumsum(counts, 0) - counts)


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    root = tmp_path_factory.mktemp("lora-graph")
    config = RunnerConfig(
        device="cpu", dtype="float32", num_kv_slots=1024, max_rows=8, show_progress=False, max_loras=4, max_lora_rank=16
    )
    runner = ModelRunner(config)
    assert runner.lora is not None
    for adapter_id in (1, 2, 3):
        folder = write_smollm2_adapter(root / f"a{adapter_id}", rank=8 * adapter_id - 8 or 4, seed=adapter_id)
        runner.lora.add(adapter_id, load_peft_adapter(f"a{adapter_id}", str(folder)))
    return runner


def _decode_batch(tokens: list[int], kv_lens: list[int], slots: list[int] | None):
    rows = list(range(len(tokens)))
    batch = build_forward_batch(
        tokens, rows, [1] * len(tokens), kv_lens, [100 * r + k - 1 for r, k in zip(rows, kv_lens)], rows
    )
    batch.lora = None if slots is None else LoraBatch(torch.tensor(slots, dtype=torch.int64))
    return batch


@torch.inference_mode()
def test_graph_steps_equal_the_eager_steps(runner):
    assert runner.lora is not None and runner.cuda_graphs is None  # CPU: eager, the graphs' steps run by hand
    q_lens = [len(p) for p in PROMPTS]
    prefill = build_forward_batch(
        [t for p in PROMPTS for t in p], list(range(len(PROMPTS))), q_lens, q_lens,
        [100 * r + j for r, n in enumerate(q_lens) for j in range(n)], list(range(sum(q_lens))),
    )  # fmt: skip
    prefill.lora = LoraBatch(torch.tensor(SLOTS), [(0, 1), (2, 3)])
    runner.forward(prefill)
    graphs = DecodeCudaGraphs(
        runner._forward_eager, [2, 8], pad_row=runner.max_rows, pad_slot=runner.num_kv_slots,
        max_seq_len=runner.max_seq_len, device=runner.device, lora=runner.lora,
    )  # fmt: skip
    tokens, kv_lens = [11, 12, 13, 14, 15], [n + 1 for n in q_lens]
    for slots in (SLOTS, None, [1, -1, -1, -1, -1]):  # LoRA, plain, then a slot loaded after the graphs were made
        batch = _decode_batch(tokens, kv_lens, slots)
        if slots is not None and 1 in slots:
            batch.lora = LoraBatch(torch.tensor(slots), [(1, 2)])  # copied into the slot's buffers, in place
        eager = runner.forward(batch).clone()
        key = graphs.load_inputs(batch)
        assert key == (8, slots is not None)
        assert graphs.inputs.lora_slots[5:8].tolist() == [-1, -1, -1]  # padding rows run on the base model
        replayed = graphs.graph_step(*key)()[: len(tokens)]
        graphs.end_graph_steps()
        assert runner.lora.context.step is None
        torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=2e-4)  # 8 rows vs 5: other sum orders
    base = runner.forward(_decode_batch(tokens, kv_lens, None))
    lora = runner.forward(_decode_batch(tokens, kv_lens, SLOTS))
    assert not torch.allclose(base[1], lora[1])  # the adapters do change their rows
    torch.testing.assert_close(base[0], lora[0], rtol=1e-5, atol=1e-5)
