"""The embedded SmolLM2 with `--quantize fp8` (emulated on CPU: the same FP8 roundings as the GPU's
_scaled_mm) picks the unquantized model's greedy token at most positions of 20 prompts.

Teacher-forced (one prefill per prompt, the argmax at every position compared), so a divergence is
counted once instead of derailing the rest of a free-running sequence, and the test costs two
forwards per prompt. Measured: 189/213 = 88.7% (for scale, bf16 vs fp32 agree at ~94% on the same
positions); the bound is set just under it, so a broken scale or layout (which scores near 0) fails."""

from __future__ import annotations

import pytest

from tests.modeling.helpers import full_logits
from tests.modeling.test_greedy_parity import PROMPTS
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

MORE_PROMPTS = [
    "The largest planet in the solar system is Jupiter, a gas giant with",
    "A haiku about autumn:\nLeaves fall from the trees",
    "To make a cup of tea, first boil the water, then",
    "The French word for cat is chat, and the word for dog is",
    "SELECT name FROM users WHERE age > 30 ORDER BY",
    "<|im_start|>user\nWho wrote Hamlet?<|im_end|>\n<|im_start|>assistant\n",
    "The speed of light in a vacuum is about 300,000 kilometres per",
    "for i in range(10):\n    print(i)\n",
    "Photosynthesis is the process by which plants turn sunlight into",
    "<|im_start|>user\nTranslate 'hello' to Spanish.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def fp8_runner() -> ModelRunner:
    return ModelRunner(
        RunnerConfig(device="cpu", dtype="float32", num_kv_slots=4096, max_rows=4, show_progress=False, quantize="fp8")
    )


def test_fp8_greedy_tokens_agree_with_unquantized(smollm2_runner, fp8_runner, smollm2_tokenizer):
    assert fp8_runner.model.model.layers[0].mlp.down_proj.method.name == "fp8"
    same = total = 0
    for text in PROMPTS + MORE_PROMPTS:
        ids = smollm2_tokenizer(text).input_ids
        reference = full_logits(smollm2_runner, ids).argmax(-1)
        quantized = full_logits(fp8_runner, ids).argmax(-1)
        same += int((reference == quantized).sum())
        total += len(ids)
    agreement = same / total
    print(f"FP8 vs fp32 greedy (teacher-forced) agreement on SmolLM2-135M: {same}/{total} = {agreement:.1%}")
    assert agreement >= 0.85
