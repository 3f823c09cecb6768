"""--diverse_mode end to end on CPU: n = 4 siblings (and a stranger) through the offline engine on a tiny Llama
with the Triton backend (kernels interpreted). Greedy and seeded outputs equal diverse mode off, and the decode
steps really ran the shared-prefix kernel over a group of the four siblings."""

from __future__ import annotations

import pytest

from tgi_compat.modeling.attention import triton_backend
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


@pytest.fixture(scope="module")
def mode_off(tiny_weights):
    """The tokens with diverse mode off, per do_sample: computed once for the module's tests."""
    tokens: dict[bool, list[list[int]]] = {}

    def get(do_sample: bool) -> list[list[int]]:
        if do_sample not in tokens:
            off, no_groups = generate(tiny_weights, False, _sampling(do_sample))
            assert no_groups == []
            tokens[do_sample] = off
        return tokens[do_sample]

    return get


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "seeded"])
def test_diverse_mode_gives_the_same_tokens_and_groups_the_siblings(tiny_weights, mode_off, do_sample):
    _same_tokens_and_grouped(tiny_weights, mode_off(do_sample), do_sample)


@pytest.mark.parametrize("final", [False, True], ids=["partials", "final"])
def test_group_programs_reading_their_members_own_keys_give_the_same_tokens(tiny_weights, mode_off, final, monkeypatch):
    """The kernel's other form (shared_prefix.py's group_suffix) over seeded siblings and a stranger: the backend's
    prefix splits (2 here: partials and stage 2), and one (outputs written final, as at 64 groups on an H100)."""
    monkeypatch.setattr(triton_backend, "SHARED_PREFIX_GROUP_SUFFIX", True)
    if final:  # (before the runner sizes its scratch by it)
        monkeypatch.setattr(
            TritonAttentionBackend, "_prefix_splits", lambda self, batch: int(self.prefix_group_max > 0)
        )
    _same_tokens_and_grouped(tiny_weights, mode_off(True), do_sample=True)


def _sampling(do_sample: bool) -> list[SamplingParams]:
    """Seeded siblings: one seed each, as the server gives n siblings."""
    return [SamplingParams(do_sample=do_sample, seed=5 + i, temperature=1.3 if do_sample else 1.0) for i in range(5)]


def _same_tokens_and_grouped(tiny_weights, off: list[list[int]], do_sample: bool) -> None:
    on, group_sizes = generate(tiny_weights, True, _sampling(do_sample))
    assert on == off
    assert group_sizes and max(group_sizes) == 4  # the siblings' later decode steps read the prompt once
    if do_sample:
        assert len({tuple(tokens) for tokens in on[:4]}) > 1  # seeded siblings differ
