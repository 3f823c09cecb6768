"""The seam every draft proposer implements: one object per request, fed its tokens as they grow."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class DraftProposer(Protocol):
    def extend(self, tokens: Sequence[int]) -> None:
        """Append the request's next tokens (the prompt first, then each generated token once)."""
        ...

    def propose(self, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens likely to follow everything extended so far ([] when nothing matches)."""
        ...
