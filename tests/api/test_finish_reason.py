"""One set of finish reasons: the engine's completed ones are exactly TGI's wire values."""

from typing import get_args

from tgi_compat.api.protocol import tgi as schemas
from tgi_compat.router.request import COMPLETED_FINISH_REASONS, FinishReason


def test_the_wire_finish_reasons_are_the_engines_completed_ones():
    assert set(get_args(schemas.FinishReason)) == set(COMPLETED_FINISH_REASONS)
    assert {FinishReason.ABORT, FinishReason.ERROR}.isdisjoint(get_args(schemas.FinishReason))
