"""Grammar-constrained decoding in the real engine (SmolLM2 on CPU, overlap scheduling forced on, and
off for the comparison: constrained steps sample after the previous step's update, same tokens)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from smollm2_cases import smollm2_engine_config

from tgi_compat.router.engine import EngineCore
from tgi_compat.router.request import GenerateRequest, GrammarKind, GrammarSpec, SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
}
IPV4 = r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)"


@pytest.fixture(scope="module")
def engine():
    return EngineCore.from_config(smollm2_engine_config(overlap_scheduling=True))


@pytest.fixture(scope="module")
def plain_engine():
    return EngineCore.from_config(smollm2_engine_config(overlap_scheduling=False))


@pytest.fixture(scope="module")
def tokenizer(engine):
    from tgi_compat.modeling.tokenizer import load_tokenizer

    return load_tokenizer(engine.config.model_id)


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def run(engine: EngineCore, requests: list[GenerateRequest], abort: str | None = None) -> dict[str, list]:
    for request in requests:
        engine.add_request(request)
    if abort is not None:
        engine.abort(abort)
    events: dict[str, list] = {}
    while engine.has_unfinished():
        for event in engine.step():
            events.setdefault(event.request_id, []).append(event)
    assert engine.pool.is_full_free()
    assert engine.scheduler.num_constrained == 0
    return events


def output(tokenizer, events) -> tuple[str, str]:
    ids = [i for event in events for i in event.token_ids]
    return tokenizer.decode(ids, skip_special_tokens=True), events[-1].finish_reason


def fresh_matcher(engine: EngineCore, spec: GrammarSpec):
    """A new matcher of a grammar the engine compiled (and keeps)."""
    import xgrammar

    return xgrammar.GrammarMatcher(engine.selector.grammar.compiled.get(spec))


def json_spec(schema) -> GrammarSpec:
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))


def test_constrained_requests_match_their_grammar_beside_a_plain_one(engine, tokenizer):
    prompt = chat(tokenizer, "Describe a user as JSON.")
    plain = GenerateRequest("plain", prompt, max_new_tokens=12)
    alone = output(tokenizer, run(engine, [plain])["plain"])
    seeded = SamplingParams(do_sample=True, temperature=0.8, seed=7)
    events = run(
        engine,
        [
            GenerateRequest("json", prompt, max_new_tokens=60, grammar=json_spec(PERSON)),
            GenerateRequest("sampled", prompt, seeded, max_new_tokens=60, grammar=json_spec(PERSON)),
            GenerateRequest(
                "ip", chat(tokenizer, "An IP address?"), max_new_tokens=20, grammar=GrammarSpec(GrammarKind.REGEX, IPV4)
            ),
            GenerateRequest("plain", prompt, max_new_tokens=12),
        ],
    )
    for name in ("json", "sampled"):
        text, finish = output(tokenizer, events[name])
        assert finish == "eos_token", text
        jsonschema.validate(json.loads(text), PERSON)
    text, finish = output(tokenizer, events["ip"])
    assert finish == "eos_token" and re.fullmatch(IPV4, text), text
    assert output(tokenizer, events["plain"]) == alone  # neighbours' masks never touch its row


def test_seeds_whose_noise_peaks_on_a_forbidden_token_follow_the_grammar(engine, tokenizer):
    # At their first step seeds 10, 50 and 189 draw the largest uniform of the hash on tokens no IPv4 answer
    # starts with ("      ", ...); float32 rounded it to 1.0, the noise was +inf and beat the mask's -inf
    # (issue 15: a batched JSON answer's enum came out as " relativeadmin").
    ip = GrammarSpec(GrammarKind.REGEX, IPV4)
    prompt = chat(tokenizer, "An IP address?")
    seeds = (10, 50, 189)
    requests = [
        GenerateRequest(f"s{seed}", prompt, SamplingParams(do_sample=True, temperature=0.7, seed=seed), 16, grammar=ip)
        for seed in seeds
    ]
    events = run(engine, [*requests, GenerateRequest("plain", prompt, max_new_tokens=4)])
    for seed in seeds:
        ids = [i for event in events[f"s{seed}"] for i in event.token_ids]
        matcher = fresh_matcher(engine, ip)
        assert all(matcher.accept_token(i) for i in ids), tokenizer.decode(ids)


@pytest.mark.parametrize("spec", [json_spec(PERSON), GrammarSpec(GrammarKind.ANY_JSON)], ids=["schema", "any"])
def test_a_length_capped_answer_is_a_prefix_of_a_match(engine, tokenizer, spec):
    events = run(engine, [GenerateRequest("short", chat(tokenizer, "JSON?"), max_new_tokens=4, grammar=spec)])
    ids = [i for event in events["short"] for i in event.token_ids]
    assert events["short"][-1].finish_reason == "length" and len(ids) == 4
    matcher = fresh_matcher(engine, spec)
    assert all(matcher.accept_token(i) for i in ids) and not matcher.is_terminated()


def test_a_grammar_that_does_not_compile_is_rejected_and_the_engine_serves_on(engine, tokenizer):
    prompt = chat(tokenizer, "Hi")
    events = run(
        engine,
        [
            GenerateRequest("bad", prompt, max_new_tokens=5, grammar=GrammarSpec(GrammarKind.REGEX, "(((")),
            GenerateRequest(
                "badref", prompt, max_new_tokens=5, grammar=json_spec({"properties": {"a": {"$ref": "#/x"}}})
            ),
            GenerateRequest("ok", prompt, max_new_tokens=3),
        ],
    )
    (bad,) = events["bad"]
    assert bad.finish_reason == "rejected"
    assert bad.error == "grammar is not valid: Regex parsing error at position 4: The parenthesis is not closed."
    assert events["badref"][0].error.startswith("cannot compile regex from schema: ")
    assert events["ok"][-1].finish_reason == "length"


def test_aborting_a_request_while_its_grammar_compiles(engine, tokenizer):
    events = run(engine, [GenerateRequest("gone", chat(tokenizer, "Hi"), grammar=json_spec(PERSON))], abort="gone")
    assert [e.finish_reason for e in events["gone"]] == ["abort"]


def test_top_tokens_of_a_forced_step_leave_out_the_masked_ones():
    import torch

    from tgi_compat.router.sampling.sampler import top_n_with_ties

    logprobs = torch.full((1, 50), float("-inf"))
    logprobs[0, 7] = 0.0  # the grammar allows one token only
    counts = top_n_with_ties(logprobs, torch.tensor([3]), 3).counts
    assert counts.tolist() == [1]  # TGI: -inf alternatives are not reported (not 50 ties at -inf)


def test_a_completed_grammar_with_ignore_eos_goes_on_with_stop_tokens_beside_a_plain_one(engine, tokenizer):
    # xgrammar refuses to fill a mask once its matcher accepted the stop token; the request must not
    # fail (nor fail the step, and with it every request in the batch).
    digit = GrammarSpec(GrammarKind.REGEX, r"\d")
    prompt = chat(tokenizer, "A digit?")
    constrained = GenerateRequest("done", prompt, max_new_tokens=6, grammar=digit, ignore_eos=True)
    events = run(engine, [constrained, GenerateRequest("plain", prompt, max_new_tokens=6, ignore_eos=True)])
    for request_id in ("done", "plain"):
        assert [event.error for event in events[request_id]] == [None] * len(events[request_id])
        assert events[request_id][-1].finish_reason == "length"
    ids = [i for event in events["done"] for i in event.token_ids]
    assert len(ids) == 6 and tokenizer.decode(ids[:1]).isdigit()
    assert set(ids[2:]) <= set(engine.selector.grammar.compiler.stop_token_ids)


def test_overlapped_constrained_steps_give_the_plain_steps_answers(engine, plain_engine, tokenizer, monkeypatch):
    # Overlap on: forward N is queued before the matchers accept N-1's tokens, the masks of N are filled
    # after them, and N is sampled last. Same tokens as plain steps for a grammar that completes early, a
    # length-capped one, a stop id inside the answer, seeded best_of-style siblings and a plain neighbour.
    prompt, schema = chat(tokenizer, "Describe a user as JSON."), json_spec(PERSON)
    probe = run(plain_engine, [GenerateRequest("probe", prompt, max_new_tokens=8, grammar=schema)])["probe"]
    stop_id = [i for event in probe for i in event.token_ids][5]

    def requests() -> list[GenerateRequest]:
        seeded = [SamplingParams(do_sample=True, temperature=0.9, seed=seed) for seed in (1, 2)]
        return [
            GenerateRequest("json", prompt, max_new_tokens=60, grammar=schema),
            GenerateRequest("capped", prompt, max_new_tokens=5, grammar=schema),
            GenerateRequest(
                "digit", chat(tokenizer, "A digit?"), max_new_tokens=10, grammar=GrammarSpec(GrammarKind.REGEX, r"\d")
            ),
            GenerateRequest("stop", prompt, max_new_tokens=60, stop_token_ids=[stop_id], grammar=schema),
            *[
                GenerateRequest(f"best_of{i}", prompt, p, max_new_tokens=40, grammar=schema)
                for i, p in enumerate(seeded)
            ],
            GenerateRequest("plain", prompt, max_new_tokens=12),
        ]

    def tokens(events) -> dict[str, tuple]:
        return {k: ([i for e in v for i in e.token_ids], v[-1].finish_reason) for k, v in events.items()}

    overlapping: list[bool] = []  # per launch: was the step before it still unread (overlap on)?
    launch = engine.executor.launch
    monkeypatch.setattr(
        engine.executor,
        "launch",
        lambda plan, previous=None, **kw: (overlapping.append(previous is not None), launch(plan, previous, **kw))[1],
    )
    overlapped = tokens(run(engine, requests()))
    assert tokens(run(plain_engine, requests())) == overlapped
    assert {k: reason for k, (_, reason) in overlapped.items()} == {
        "json": "eos_token",
        "capped": "length",
        "digit": "eos_token",
        "stop": "stop_sequence",
        "best_of0": "eos_token",
        "best_of1": "eos_token",
        "plain": "length",
    }
    assert len(overlapped["digit"][0]) == 2  # the digit, then EOS: it ended while the others went on
    # Every launch but the first of a run overlapped the step before it (a compile wait may add one).
    assert len(overlapping) >= 20 and overlapping.count(False) <= 2, overlapping


def test_a_deferred_sampling_that_fails_runs_its_step_again_where_failures_are_contained(
    engine, plain_engine, tokenizer, monkeypatch
):
    prompt, schema = chat(tokenizer, "Describe a user as JSON."), json_spec(PERSON)
    sample, calls = engine.executor.sample, []

    def flaky_sample(launched):
        calls.append(len(calls))
        if len(calls) == 3:
            raise RuntimeError("injected")
        sample(launched)

    monkeypatch.setattr(engine.executor, "sample", flaky_sample)

    def requests() -> list[GenerateRequest]:
        return [GenerateRequest(name, prompt, max_new_tokens=12, grammar=schema) for name in ("a", "b")]

    overlapped = run(engine, requests())
    assert len(calls) > 3
    expected = run(plain_engine, requests())
    for name in ("a", "b"):
        assert output(tokenizer, overlapped[name]) == output(tokenizer, expected[name])


# Extreme parameters (issue 15's soak: "token 0 is outside its grammar"). In float32 a temperature of 1e39
# is inf (masked -inf / inf = NaN) and one of 1e-46 is 0 (x / 0 = +inf, whose log_softmax is NaN); a
# repetition penalty of 1e-46 is 0 too; argmax took the row's first NaN, token 0.
OVERLAPPED_EXTREMES = {  # no penalty: these steps overlap (the sampling deferred past the forward)
    "inf_temperature": SamplingParams(do_sample=True, temperature=1e39, seed=1),
    "zero_temperature": SamplingParams(do_sample=True, temperature=1e-46, seed=2),
    "inf_temperature_top_n": SamplingParams(temperature=1e39, top_n_tokens=3, seed=5),
}
SYNCHRONOUS_EXTREMES = {  # penalties read the request's own tokens: the engine runs these steps one by one
    "zero_repetition_penalty_seeded": SamplingParams(do_sample=True, repetition_penalty=1e-46, seed=3),
    "zero_repetition_penalty_greedy": SamplingParams(repetition_penalty=1e-46),
    "everything": SamplingParams(
        do_sample=True, temperature=1e39, top_k=2, top_p=1e-9, typical_p=1e-9, frequency_penalty=2.0, seed=4
    ),
}


@pytest.mark.parametrize("extremes", [OVERLAPPED_EXTREMES, SYNCHRONOUS_EXTREMES], ids=["overlapped", "synchronous"])
def test_extreme_parameters_never_leave_the_grammar(engine, tokenizer, caplog, extremes):
    prompt, schema = chat(tokenizer, "Describe a user as JSON."), json_spec(PERSON)
    date = GrammarSpec(GrammarKind.REGEX, r"(19|20)\d\d-(0[1-9]|1[0-2])")
    requests = [
        GenerateRequest(f"{name}/{kind}", prompt, params, max_new_tokens=10, grammar=spec)
        for name, params in extremes.items()
        for kind, spec in (("json", schema), ("date", date))
    ]
    events = run(engine, [*requests, GenerateRequest("plain", prompt, max_new_tokens=4)])
    assert "outside its grammar" not in caplog.text
    for generate in requests:
        ids = [i for event in events[generate.request_id] for i in event.token_ids]
        matcher = fresh_matcher(engine, generate.grammar)
        assert all(matcher.accept_token(i) for i in ids), (generate.request_id, ids)
        if generate.grammar is date:
            assert events[generate.request_id][-1].finish_reason == "eos_token", (generate.request_id, ids)


def confined_sampling(logits, allowed: list[set[int] | None], seed: int = 0, **sampling):
    """Sample `logits` [B, V] with rows i constrained to allowed[i] (None: unconstrained), row i seeded seed + i."""
    import dataclasses

    import torch

    from tgi_compat.router.request import Request
    from tgi_compat.router.sampling.batch import SamplingBatch
    from tgi_compat.router.sampling.grammar import GrammarMask
    from tgi_compat.router.sampling.sampler import Sampler

    num_rows, vocab = logits.shape
    requests = [
        Request(GenerateRequest(f"r{i}", [1], SamplingParams(**sampling)), 0, seed=seed + i) for i in range(num_rows)
    ]
    rows = [i for i, tokens in enumerate(allowed) if tokens is not None]
    words = torch.zeros(len(rows), (vocab + 31) // 32, dtype=torch.int64)  # compact: the constrained rows
    for k, row in enumerate(rows):
        for token in allowed[row] or ():
            words[k, token // 32] |= 1 << (token % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    row_index = None if len(rows) == num_rows else torch.tensor(rows, dtype=torch.int32)
    batch = SamplingBatch.build(requests, vocab, torch.device("cpu"))
    batch = dataclasses.replace(batch, grammar=GrammarMask(bitmask, row_index))
    return Sampler(vocab, "cpu")(logits.clone(), batch)


def test_a_row_whose_allowed_scores_are_all_gone_chooses_among_its_allowed_tokens():
    import torch

    logits = torch.randn(3, 70)
    logits[0, [5, 40]] = float("-inf")  # every allowed token of row 0 penalised away
    logits[1] = float("nan")  # a model that produced NaN
    logits[2, 3] = 100.0  # an unconstrained neighbour
    greedy = confined_sampling(logits, [{5, 40}, {7, 66}, None])
    assert greedy.token_ids.tolist() == [5, 7, 3]  # the lowest allowed id: deterministic, never token 0
    assert torch.isfinite(greedy.logprobs).all()
    for seed in range(8):
        sampled = confined_sampling(logits, [{5, 40}, {7, 66}, None], do_sample=True, seed=seed)
        assert sampled.token_ids[:2].tolist() == [5, 7]


def test_the_lowest_allowed_id_is_read_from_any_bit_of_the_bitmask():
    import torch

    for lowest in (0, 1, 31, 32, 63, 64, 95, 96, 127):  # every bit position of a word, the sign bit too
        logits = torch.full((1, 130), float("-inf"))
        assert confined_sampling(logits, [{lowest, 129}]).token_ids.item() == lowest


@pytest.mark.parametrize("temperature", [1e39, 1e-46], ids=["inf", "zero"])
def test_a_temperature_that_float32_cannot_hold_stays_inside_the_grammar(temperature):
    import torch

    logits = torch.randn(2, 70)
    logits[:, 0] = 50.0  # the forbidden favourite
    for seed in range(8):
        out = confined_sampling(logits, [{9, 33}, {12}], do_sample=True, temperature=temperature, seed=seed)
        assert out.token_ids[0].item() in {9, 33} and out.token_ids[1].item() == 12
        assert torch.isfinite(out.logprobs).all()
