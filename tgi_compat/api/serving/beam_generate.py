"""TGI's /generate (and POST /) with beam search: `parameters.use_beam_search` (ours, vLLM's name), or LightLLM's
`--beam_mode` for a request with `best_of` > 1 and no sampling. `best_of` beams are searched
(tgi_compat/api/serving/beam_search.py); the best hypothesis is the answer and, with `details`, the others are
TGI's `best_of_sequences`, best first. Sampling parameters do not combine with it (it scores the model's own
distribution)."""

from __future__ import annotations

from tgi_compat.api.protocol.errors import validation_error
from tgi_compat.api.protocol.tgi import GenerateParameters, Token
from tgi_compat.api.serving.beam_search import Beam, BeamSearchParams, beam_search
from tgi_compat.api.serving.frame import RequestFrame
from tgi_compat.api.serving.generation import GenerationResult
from tgi_compat.api.serving.state import AppState
from tgi_compat.api.serving.validation import ValidatedRequest, check_best_of_limits, is_sampling


def wants_beam_search(params: GenerateParameters, beam_mode: bool) -> bool:
    if params.use_beam_search is not None:
        return params.use_beam_search
    return beam_mode and (params.best_of or 1) > 1 and not is_sampling(params)


def check_not_streamed(params: GenerateParameters) -> None:
    """A stream cannot carry a beam search: its tokens are only known once the search ends."""
    if params.use_beam_search:
        raise validation_error("`use_beam_search` is not supported when streaming tokens")


async def generate_beams(
    state: AppState, frame: RequestFrame, inputs: str, params: GenerateParameters
) -> tuple[ValidatedRequest, list[GenerationResult]]:
    """(the validated request, its hypotheses best first) under `best_of` permits."""
    if is_sampling(params):
        raise validation_error("beam search scores the model's own distribution: no sampling parameters")
    check_best_of_limits(params, state.limits)
    width = max(params.best_of or 1, 1)
    async with frame.admit(inputs, params.model_copy(update={"best_of": None}), permits=width) as admitted:
        request = admitted.request
        early_stopping = False if params.early_stopping is None else params.early_stopping
        length_penalty = 1.0 if params.length_penalty is None else params.length_penalty
        eos = frozenset(state.engine.info.eos_token_ids)
        search = BeamSearchParams(width, request.max_new_tokens, length_penalty, early_stopping, eos)
        beams = await beam_search(state.engine, request.prompt_ids, search)
    return request, [_result(state, request, beam) for beam in beams]


def _result(state: AppState, request: ValidatedRequest, beam: Beam) -> GenerationResult:
    tokenizer = state.tokenizer
    ended = bool(beam.token_ids) and beam.token_ids[-1] in state.engine.info.eos_token_ids
    tokens = [
        Token(id=t, text=tokenizer.token_text(t), logprob=lp, special=tokenizer.is_special(t))
        for t, lp in zip(beam.token_ids, beam.logprobs)
    ]
    return GenerationResult(
        generated_text=tokenizer.decode(beam.token_ids[:-1] if ended else beam.token_ids, skip_special_tokens=True),
        finish_reason="eos_token" if ended else "length",
        seed=None,
        input_length=request.input_length,
        tokens=tokens,
    )
