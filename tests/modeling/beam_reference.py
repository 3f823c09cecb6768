"""transformers' beam search, the reference of tgi_compat/api/serving/beam_search.py's tests."""

from __future__ import annotations

from tests.modeling.helpers import transformers_generate


def transformers_beams(
    model,
    prompt_ids: list[int],
    num_beams: int,
    max_new_tokens: int,
    eos_token_id: int,
    *,
    num_return: int = 1,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
) -> list[tuple[list[int], float]]:
    """The `num_return` best hypotheses of `generate(num_beams=...)`: (generated ids, padded with EOS, and score)."""
    out = transformers_generate(
        model,
        prompt_ids,
        eos_token_id,
        max_new_tokens,
        num_beams=num_beams,
        num_return_sequences=num_return,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        return_dict_in_generate=True,
        output_scores=True,
    )
    return [(seq[len(prompt_ids) :].tolist(), float(score)) for seq, score in zip(out.sequences, out.sequences_scores)]
