"""PaliGemma (on Gemma, and PaliGemma 2 on Gemma 2) through the real engine (scheduler, batch builder, encoder cache,
the transformers fallback's runner) on a tiny random checkpoint: the whole prompt attends both ways in its prefill
(one span from position 0, even under 7-token prefill chunks) and positions start at 1, so greedy ids equal
transformers' given the processor's token_type_ids, with one image and with two in the same steps; the same
prompt again is encoded once and hits the prefix cache, and the same image under another question shares no K/V."""

from __future__ import annotations

from functools import partial

import pytest

from benchmarks.device.steps import engine_tokens
from tests.modeling import paligemma_helpers as pali
from tests.modeling.idefics3_helpers import WIDE
from tests.router.test_idefics3_engine import make_engine


@pytest.fixture(scope="module", params=["gemma", "gemma2"])
def checkpoint(request, tmp_path_factory):
    return pali.saved_paligemma(tmp_path_factory.mktemp(f"paligemma-{request.param}"), request.param)


def test_greedy_ids_equal_transformers_whole_and_chunked(checkpoint):
    model, folder = checkpoint
    for prefill in (4096, 7):  # a 7-token budget still takes each prompt whole: it is one span
        pali.check_images_beside_text(
            model, partial(engine_tokens, make_engine(folder, max_batch_prefill_tokens=prefill))
        )


def test_the_same_prompt_hits_the_prefix_cache_another_question_does_not(checkpoint):
    model, folder = checkpoint
    engine = make_engine(folder)
    first = engine_tokens(engine, [pali.engine_request("first", [WIDE], [40, 41, 42])[0]])
    cached: dict[str, int] = {}
    for request, _ in (pali.engine_request("again", [WIDE], [40, 41, 42]), pali.engine_request("other", [WIDE], [40])):
        engine.add_request(request)
        tokens = []
        while engine.has_unfinished():
            for event in engine.step():
                tokens += event.token_ids
                cached[event.request_id] = max(cached.get(event.request_id, 0), event.num_cached_tokens)
        if request.request_id == "again":
            assert tokens == first["first"]
    other_ids = pali.engine_request("other", [WIDE], [40])[1]
    assert cached == {"again": pali.PER_IMAGE + 4, "other": 0}  # all but the last prompt token; nothing
    assert tokens == pali.greedy_ids(model, other_ids, [WIDE], pali.NEW)
    assert engine.executor.batch_builder.images is not None and engine.executor.batch_builder.images.num_encoded == 1


def test_an_older_transformers_is_refused_at_load_naming_the_version_needed(checkpoint, monkeypatch):
    """The fallback's vision families read transformers 5.25's image rows: an older release is refused when the model
    loads, with the version to install, instead of failing each step with an image (5.17 did, on the GPU machine)."""
    import transformers

    _, folder = checkpoint
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(RuntimeError, match=r"PaliGemmaForConditionalGeneration .* >= 5\.25; this is 5\.17\.0"):
        make_engine(folder)
