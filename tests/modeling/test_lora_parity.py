"""LoRA against peft: one batch of base, adapter-1, adapter-2 and adapter-3 rows (r = 8, 16, 64 on all seven
projections of the embedded SmolLM2) gives, row by row, the greedy tokens and logprobs of the peft-merged model
of that row's adapter (the base model for the base row)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.lora_adapters import write_smollm2_adapter
from tests.modeling.helpers import max_rel_error
from tgi_compat.modeling.forward_batch import LoraBatch, build_forward_batch
from tgi_compat.modeling.lora import weights as lora_weights
from tgi_compat.modeling.lora.adapter import load_peft_adapter
from tgi_compat.modeling.lora.placement import pack, packed_nbytes
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

RANKS = {"a1": 8, "a2": 16, "a3": 64}
PROMPTS = [[1, 9690, 314, 253, 2087], [1, 504, 3458, 282, 4195, 314], [1, 1350, 30, 2492], [1, 9690, 314, 253, 2087]]
ROW_ADAPTERS = [None, "a1", "a2", "a3"]  # the last prompt is the base row's again: only the adapter differs
NUM_NEW = 6
TOLERANCE = 2e-4  # float32, relative to the largest logit


@pytest.fixture(scope="module")
def adapter_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {name: write_smollm2_adapter(root / name, rank, seed=i) for i, (name, rank) in enumerate(RANKS.items())}


@pytest.fixture(scope="module")
def lora_runner(adapter_folders) -> ModelRunner:
    config = RunnerConfig(
        device="cpu", dtype="float32", num_kv_slots=1024, max_rows=8, show_progress=False, max_loras=4, max_lora_rank=64
    )
    runner = ModelRunner(config)
    assert runner.lora is not None
    for adapter_id, (name, folder) in enumerate(adapter_folders.items(), start=1):
        runner.lora.add(adapter_id, load_peft_adapter(name, str(folder)))
    return runner


def _lora_batch(slots: list[int], loads: list[tuple[int, int]] | None = None) -> LoraBatch:
    return LoraBatch(torch.tensor(slots, dtype=torch.int64), loads or [])


def _run_mixed_batch(runner: ModelRunner) -> tuple[list[list[int]], list[list[float]], torch.Tensor]:
    """Prefill all four rows in one step, then decode them together greedily: (tokens, logprobs, prefill logits)."""
    slots = [-1, 0, 1, 2]  # the router's placement: adapter i in slot i - 1
    loads = [(0, 1), (1, 2), (2, 3)]
    q_lens = [len(p) for p in PROMPTS]
    starts = [100 * row for row in range(len(PROMPTS))]  # each row's KV slots start at 100 * row
    out_slots = [s + j for s, n in zip(starts, q_lens) for j in range(n)]
    batch = build_forward_batch(
        [t for p in PROMPTS for t in p], [0, 1, 2, 3], q_lens, q_lens, out_slots, list(range(sum(q_lens)))
    )
    batch.lora = _lora_batch(slots, loads)
    prefill = runner.forward(batch).clone()
    last = torch.tensor(q_lens).cumsum(0) - 1
    logits = prefill[last]
    tokens: list[list[int]] = [[] for _ in PROMPTS]
    logprobs: list[list[float]] = [[] for _ in PROMPTS]
    kv_lens = list(q_lens)
    for _ in range(NUM_NEW):
        chosen = logits.argmax(-1)
        picked = torch.log_softmax(logits.float(), -1).gather(1, chosen[:, None])[:, 0]
        for row in range(len(PROMPTS)):
            tokens[row].append(int(chosen[row]))
            logprobs[row].append(float(picked[row]))
        batch = build_forward_batch(
            chosen.tolist(), [0, 1, 2, 3], [1] * 4, [k + 1 for k in kv_lens],
            [s + k for s, k in zip(starts, kv_lens)], [0, 1, 2, 3],
        )  # fmt: skip
        batch.lora = _lora_batch(slots)
        kv_lens = [k + 1 for k in kv_lens]
        logits = runner.forward(batch)
    return tokens, logprobs, prefill


# the folded projections (the shrink in the base matmul, the folded expand: every step here is decode-sized), and
# the segmented shrink and expand that quantized bases and prefill-sized steps take
@pytest.mark.parametrize(
    "folding", [lora_weights.DEFAULT_FOLDING, lora_weights.NEVER_FOLD], ids=["folded", "segmented"]
)
def test_mixed_batch_matches_each_peft_merged_model(
    lora_runner, smollm2_hf_model, adapter_folders, folding, monkeypatch
):
    from peft import PeftModel

    monkeypatch.setattr(lora_weights, "folding", folding)
    assert lora_runner.lora is not None and all(w.folded is not None for w in lora_runner.lora.targets.values())
    tokens, logprobs, prefill = _run_mixed_batch(lora_runner)
    names = list(adapter_folders)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(smollm2_hf_model), str(adapter_folders[names[0]]), names[0])
    for name in names[1:]:
        peft_model.load_adapter(str(adapter_folders[name]), adapter_name=name)
    peft_model.eval()
    offsets = [0, *torch.tensor([len(p) for p in PROMPTS]).cumsum(0).tolist()]
    base_tokens = None
    for row, (prompt, adapter) in enumerate(zip(PROMPTS, ROW_ADAPTERS)):
        sequence = torch.tensor([prompt + tokens[row]])
        with torch.no_grad():
            if adapter is None:
                with peft_model.disable_adapter():
                    ref = peft_model(sequence).logits[0].float()
                base_tokens = tokens[row]
            else:
                peft_model.set_adapter(adapter)
                peft_model.merge_adapter()
                ref = peft_model(sequence).logits[0].float()
                peft_model.unmerge_adapter()
        n = len(prompt)
        assert max_rel_error(prefill[offsets[row] : offsets[row + 1]], ref[:n]) < TOLERANCE, (row, adapter)
        ref_steps = ref[n - 1 : n - 1 + NUM_NEW]
        assert ref_steps.argmax(-1).tolist() == tokens[row], (row, adapter)
        ref_logprobs = torch.log_softmax(ref_steps, -1).gather(1, torch.tensor(tokens[row])[:, None])[:, 0]
        assert torch.allclose(torch.tensor(logprobs[row]), ref_logprobs, atol=2e-3), (row, adapter)
    # the adapters matter: the base row and adapter-3's row share their prompt, not their answer
    assert tokens[3] != base_tokens


def test_a_step_without_lora_rows_runs_the_base_model(lora_runner, smollm2_runner):
    ids = PROMPTS[0]
    n = len(ids)
    plain = build_forward_batch(ids, [5], [n], [n], list(range(500, 500 + n)), list(range(n)))
    ours = lora_runner.forward(plain)
    assert lora_runner.lora is not None and lora_runner.lora.context.step is None
    base = smollm2_runner.forward(build_forward_batch(ids, [5], [n], [n], list(range(500, 500 + n)), list(range(n))))
    assert torch.equal(ours, base)


def test_a_staged_adapter_is_one_host_tensor_per_slot_buffer(lora_runner):
    """A load copies each slot buffer's part of an adapter in one piece (tgi_compat.modeling.lora.placement)."""
    lora = lora_runner.lora
    staged = lora.adapters[1]
    assert [weights for weights, _ in staged.tensors] == list(lora.targets.values())
    for weights, tensors in staged.tensors:
        buffers = weights.slot_buffers(0)
        assert [(t.shape, t.dtype) for t in tensors] == [(t.shape, t.dtype) for t in buffers]


def test_an_adapter_is_packed_into_one_host_buffer(lora_runner):
    """placement.pack: every staged tensor a view of one flat buffer (pinned beside a GPU: one page-locking call)."""
    staged = lora_runner.lora.adapters[1].tensors
    total = packed_nbytes(t for _, pair in staged for t in pair)
    packed = pack(staged, torch.empty(total, dtype=torch.uint8))
    storages = {t.untyped_storage().data_ptr() for _, pair in packed for t in pair}
    assert len(storages) == 1
    for (weights, pair), (packed_weights, packed_pair) in zip(staged, packed):
        assert packed_weights is weights
        assert all(torch.equal(x, y) and x.shape == y.shape for x, y in zip(pair, packed_pair))
    with pytest.raises(AssertionError):  # a buffer of the wrong size
        pack(staged, torch.empty(total + 16, dtype=torch.uint8))
