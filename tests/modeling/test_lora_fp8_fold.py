"""LoRA over an FP8 base (the embedded SmolLM2 quantized while loading; FP8 emulated on the CPU, its numbers FP8's):
the shrink folded into the FP8 GEMM, A's rows quantized per row (tgi_compat/modeling/lora/folding.py), against peft.

FP8 alone moves this small model's logits by ~15% of their range from the float32 model's, and a perturbation of one
rounding anywhere changes later FP8 roundings, so the check is relative: the folded FP8 shrink is as close to the
peft-merged float32 model as the same FP8 base with the shrink in float32 on an exact A."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.lora_adapters import write_smollm2_adapter
from tests.modeling.helpers import max_rel_error
from tgi_compat.modeling.forward_batch import LoraBatch, build_forward_batch
from tgi_compat.modeling.lora import weights as lora_weights
from tgi_compat.modeling.lora.adapter import load_peft_adapter
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

RANKS = {"a1": 8, "a2": 16, "a3": 64}
PROMPTS = [[1, 9690, 314, 253, 2087], [1, 504, 3458, 282, 4195, 314], [1, 1350, 30, 2492], [1, 9690, 314, 253, 2087]]
ROW_ADAPTERS = [None, "a1", "a2", "a3"]


@pytest.fixture(scope="module")
def adapter_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-fp8")
    return {name: write_smollm2_adapter(root / name, rank, seed=i) for i, (name, rank) in enumerate(RANKS.items())}


def fp8_lora_runner(adapter_folders, exact_a: bool) -> ModelRunner:
    config = RunnerConfig(
        device="cpu", dtype="float32", num_kv_slots=512, max_rows=8, show_progress=False, max_loras=4,
        max_lora_rank=64, quantize="fp8",
    )  # fmt: skip
    runner = ModelRunner(config)
    assert runner.lora is not None
    for weights in runner.lora.targets.values():
        assert weights.folded is not None and weights.fp8_rounded
        weights.fp8_rounded = not exact_a  # exact: A staged unrounded, the reference path
    for adapter_id, (name, folder) in enumerate(adapter_folders.items(), start=1):
        runner.lora.add(adapter_id, load_peft_adapter(name, str(folder)))
    return runner


def prefill_rows(runner: ModelRunner) -> list[torch.Tensor]:
    """Each row's prompt logits, the four rows (base, a1, a2, a3) in one step."""
    q_lens = [len(p) for p in PROMPTS]
    out_slots = [100 * row + j for row, n in enumerate(q_lens) for j in range(n)]
    batch = build_forward_batch(
        [t for p in PROMPTS for t in p], [0, 1, 2, 3], q_lens, q_lens, out_slots, list(range(sum(q_lens)))
    )
    batch.lora = LoraBatch(torch.tensor([-1, 0, 1, 2]), [(0, 1), (1, 2), (2, 3)])
    return list(runner.forward(batch).clone().split(q_lens))


def test_the_fp8_folded_shrink_is_as_close_to_peft_as_a_float32_shrink_on_the_same_base(
    adapter_folders, smollm2_hf_model, monkeypatch
):
    from peft import PeftModel

    folded = prefill_rows(fp8_lora_runner(adapter_folders, exact_a=False))  # 20 tokens: the folded projections
    monkeypatch.setattr(lora_weights, "folding", lora_weights.NEVER_FOLD)
    exact = prefill_rows(fp8_lora_runner(adapter_folders, exact_a=True))  # the segmented shrink, float32, exact A
    names = list(adapter_folders)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(smollm2_hf_model), str(adapter_folders[names[0]]), names[0])
    for name in names[1:]:
        peft_model.load_adapter(str(adapter_folders[name]), adapter_name=name)
    peft_model.eval()
    errors: dict[str, list[float]] = {"folded": [], "exact": []}
    for row, (prompt, adapter) in enumerate(zip(PROMPTS, ROW_ADAPTERS)):
        with torch.no_grad():
            if adapter is None:
                with peft_model.disable_adapter():
                    ref = peft_model(torch.tensor([prompt])).logits[0].float()
                base_error = max_rel_error(folded[row], ref)
                continue
            peft_model.set_adapter(adapter)
            peft_model.merge_adapter()
            ref = peft_model(torch.tensor([prompt])).logits[0].float()
            peft_model.unmerge_adapter()
        errors["folded"].append(max_rel_error(folded[row], ref))
        errors["exact"].append(max_rel_error(exact[row], ref))
    # the adapters matter (the base and a3 rows share their prompt) far beyond FP8's noise
    assert max_rel_error(exact[3], exact[0]) > base_error
    # each row as close as the exact shrink's, give or take FP8's noise (the base row's own error sets its floor)
    for folded_error, exact_error in zip(errors["folded"], errors["exact"]):
        assert folded_error <= 1.5 * max(exact_error, base_error), errors
    assert max(errors["exact"]) < 0.5, errors  # (FP8's own distance from float32: ~0.1-0.3 here)
