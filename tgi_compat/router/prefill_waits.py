"""Prefill sharing: a waiting request whose prompt shares a long prefix with a running request still
prefilling it (a common system prompt, `n` siblings) waits until that prefix is published to the prefix
cache, then starts with the hit: the prefix is computed once, not once per request that arrived before
it was cached. Deferred requests keep their queue place; the requests behind them are admitted meanwhile.
"""

from __future__ import annotations

from tgi_compat.router.prefix_cache import common_prefix_length
from tgi_compat.router.request import Request

# A waiting request is deferred for a sibling's prefill only when they share at least this many
# prompt tokens (or all of a shorter prompt): a short overlap costs less to compute twice than a wait.
MIN_SHARED_PREFILL_TOKENS = 256


class PrefillWaits:
    """The running requests whose prompt is not all published yet, and who waits for which of them."""

    def __init__(self) -> None:
        self.prefilling: list[Request] = []
        self._deferred: dict[Request, tuple[Request, int]] = {}  # waiting -> (sibling, tokens they share)

    def published_all(self, request: Request) -> None:
        """Its prompt is in the cache (or it stopped prefilling): nobody waits for it any longer."""
        if request in self.prefilling:
            self.prefilling.remove(request)

    def forget(self, request: Request) -> None:
        """It was admitted or finished: it waits for nobody."""
        self._deferred.pop(request, None)

    def is_deferred(self, request: Request) -> bool:
        """True while a running request is prefilling a long prefix of `request`'s prompt that is not
        in the cache yet. A sibling that is preempted, aborted or finishes leaves `prefilling`, which ends
        the wait."""
        if request.output_ids or request.needs_prompt_logprobs:
            return False  # a resumed request goes first; a scoring one computes its whole prompt anyway
        deferred = self._deferred.get(request)
        if deferred is not None:
            sibling, num_shared = deferred
            if sibling in self.prefilling and _is_worth_waiting_for(sibling, num_shared, request):
                return True
        prompt = request.params.prompt_ids
        for sibling in self.prefilling:
            if sibling.lora_id != request.lora_id:
                continue  # its K/V is cached under another adapter
            published, sibling_prompt = sibling.num_kv_written, sibling.params.prompt_ids
            if (
                published >= len(prompt) - 1
                or sibling_prompt[published : published + 1] != prompt[published : published + 1]
            ):
                continue  # they part before its first unpublished token: nothing to wait for (O(1) check)
            num_shared = common_prefix_length(prompt, sibling_prompt, limit=len(prompt) - 1)
            if _is_worth_waiting_for(sibling, num_shared, request):
                self._deferred[request] = (sibling, num_shared)
                return True
        self._deferred.pop(request, None)
        return False


def _is_worth_waiting_for(sibling: Request, num_shared: int, request: Request) -> bool:
    """`request` shares `num_shared` leading prompt tokens with `sibling`, which is prefilling them:
    wait while some are not published yet, if they are a long prefix (or all but the last token of
    a short prompt: `n` siblings)."""
    return num_shared > sibling.num_kv_written and num_shared >= min(
        MIN_SHARED_PREFILL_TOKENS, request.num_prompt_tokens - 1
    )
