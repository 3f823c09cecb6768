"""The one stop decision (tgi_compat/router/stopping.py): length, EOS and stop ids in TGI's order, with token
healing's re-covering tokens outside the length budget, on the real engine over the stand-in model."""

from __future__ import annotations

from router_fakes import drain, hash_engine

from tgi_compat.router.request import FinishReason, GenerateRequest
from tgi_compat.router.sampling.token_healing import TokenHealer, VocabularyTable

A = 10  # the only token whose text starts with "a": healing "aaa" takes it three times


def healing_engine(**config):
    engine = hash_engine(**config)
    pieces = [b"a" if i == A else b"x%d" % i for i in range(engine.info.vocab_size)]
    engine.selector.healer = TokenHealer.for_table(VocabularyTable(pieces))
    return engine


def test_re_covering_tokens_do_not_use_max_new_tokens():
    engine = healing_engine()
    engine.add_request(GenerateRequest("healed", [5, 6], max_new_tokens=4, healing_prefix="aaa", ignore_eos=True))
    engine.add_request(GenerateRequest("plain", [5, 6], max_new_tokens=4, ignore_eos=True))
    events = drain(engine)
    healed = [t for e in events["healed"] for t in e.token_ids]
    assert healed[:3] == [A, A, A] and len(healed) == 3 + 4
    assert events["healed"][-1].finish_reason == "length"
    assert len([t for e in events["plain"] for t in e.token_ids]) == 4


def test_re_covering_tokens_stop_at_max_total_tokens():
    engine = healing_engine(max_total_tokens=8)
    engine.add_request(GenerateRequest("healed", [5, 6], max_new_tokens=4, healing_prefix="aaa", ignore_eos=True))
    healed = [t for e in drain(engine)["healed"] for t in e.token_ids]
    assert len(healed) == 8 - 2  # 2 of the 3 re-covering tokens fit beside the prompt and max_new_tokens


def test_length_comes_before_eos_and_stop_ids():
    engine = hash_engine()
    first = [t for e in drain_one(engine, GenerateRequest("probe", [5, 6], max_new_tokens=1)) for t in e.token_ids]
    events = drain_one(engine, GenerateRequest("both", [5, 6], max_new_tokens=1, stop_token_ids=first))
    assert events[-1].finish_reason == FinishReason.LENGTH.value
    events = drain_one(engine, GenerateRequest("stop", [5, 6], max_new_tokens=3, stop_token_ids=first))
    assert events[-1].finish_reason == FinishReason.STOP_TOKEN.value and events[-1].token_ids == first


def drain_one(engine, request: GenerateRequest):
    engine.add_request(request)
    return drain(engine)[request.request_id]
