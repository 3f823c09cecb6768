"""--diverse_mode end to end on CPU: n = 4 siblings (and a stranger) through the offline engine on a tiny Llama
with the Triton backend (kernels interpreted). Greedy and seeded outputs equal diverse mode off, and the decode
steps really ran the shared-prefix kernel over a group of the four siblings."""

from __future__ import annotations

import pytest

from tgi_compat.modeling.attention.triton_backend import TritonAttentionBackend
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.engine import EngineCore
from tgi_compat.router.offline import LLM
from tgi_compat.router.request import SamplingParams

PROMPT = [(5 * k) % 90 + 3 for k in range(40)]


def generate(weights, diverse: bool, sampling: list[SamplingParams]) -> tuple[list[list[int]], list[int]]:
    """Four siblings of PROMPT and one other prompt; returns their tokens and each decode step's group sizes."""
    hf_config, state_dict = weights
    runner_config = RunnerConfig(
        device="cpu",
        dtype="float32",
        attention_backend="triton",
        num_kv_slots=512,
        max_rows=8,
        max_seq_len=80,
        show_progress=False,
        diverse_mode=diverse,
    )
    runner = ModelRunner.from_hf_state_dict(hf_config, state_dict, runner_config)
    config = EngineConfig(
        model_id="tiny", device="cpu", attention_backend="triton", max_running_requests=8, diverse_mode=diverse
    )
    engine = EngineCore(config, runner, runner.model_config)
    backend = runner.backend
    assert isinstance(backend, TritonAttentionBackend)
    group_sizes: list[int] = []
    init = backend.init_forward_metadata

    def spy(batch, req_to_token):
        init(batch, req_to_token)
        if backend.metadata.prefix_table is not None:
            members = backend.metadata.prefix_table[:, 1:]
            group_sizes.append(int((members >= 0).sum(1).max()))

    backend.init_forward_metadata = spy  # type: ignore[method-assign]
    prompts = [PROMPT] * 4 + [[7, 8, 9, 10, 11]]
    results = LLM(engine=engine).generate(prompts, sampling, max_new_tokens=6, ignore_eos=True)
    stats = engine.stats.report(force=True)  # what the engine reports: the grouped rows of its decode steps
    assert stats is not None and stats.diverse_grouped_rows == sum(group_sizes), (stats, group_sizes)
    return [r.token_ids for r in results], group_sizes


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "seeded"])
def test_diverse_mode_gives_the_same_tokens_and_groups_the_siblings(tiny_weights, do_sample):
    # seeded siblings: one seed each, as the server gives n siblings
    sampling = [
        SamplingParams(do_sample=do_sample, seed=5 + i, temperature=1.3 if do_sample else 1.0) for i in range(5)
    ]
    off, no_groups = generate(tiny_weights, False, sampling)
    on, group_sizes = generate(tiny_weights, True, sampling)
    assert on == off
    assert no_groups == []
    assert group_sizes and max(group_sizes) == 4  # the siblings' later decode steps read the prompt once
    if do_sample:
        assert len({tuple(tokens) for tokens in on[:4]}) > 1  # seeded siblings differ
