"""Continuous batching over a token-granular KV pool, in vLLM v1's `num_computed_tokens` style.

There is no prefill phase and no decode phase. Each step, every running request asks for the
tokens between its `num_computed_tokens` and its `num_tokens`: one for a decode, up to the
remaining prefill-token budget for a prompt (so a long prompt is chunked at
max_batch_prefill_tokens and shares steps with decodes). Waiting requests join while the
future-memory estimate (tgi_compat/router/admission.py) says they fit. If the pool still runs dry, the newest
running request is preempted: its slots are freed and it goes back to the head of the queue, to
re-prefill prompt + generated later. Nothing is ever dropped.

With prefix caching (tgi_compat/router/prefix_cache.py, owned by the KV pool) an admitted request starts past
the longest cached prefix of its tokens, and a request that finishes or is preempted gives its
written tokens to the cache instead of the free list, so a preempted request comes back as a hit.
A prompt's K/V is published to the cache chunk by chunk as its prefill steps complete. A waiting
request whose prompt shares a long prefix with one still being prefilled (a common system prompt,
`n` siblings) is deferred until that prefix is published, then admitted with the hit: the prefix is
computed once, not once per request that arrived before it was cached. Deferred requests keep
their place; the requests behind them are admitted meanwhile.

A chunk advances `num_computed_tokens` when it is scheduled, and its sampled token is appended by
update(). With overlap scheduling (tgi_compat/router/engine.py) the next step is scheduled before update()
has seen the step in flight: its sampled tokens are then counted as pending (`tokens_in_flight`;
the scheduler keeps only that count, the executor knows which output row holds each), a pending
token is the input of the request's next decode, and a request whose pending token is its last by
length is not scheduled again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tgi_compat.router.admission import AdmissionLimits, RequestTokens, can_admit
from tgi_compat.router.kv_slots import KVSlotPool
from tgi_compat.router.lora_slots import LoraSlots
from tgi_compat.router.outputs import TokenEvent
from tgi_compat.router.prefix_cache import PrefixCache, common_prefix_length
from tgi_compat.router.request import FinishReason, Request, RequestStatus
from tgi_compat.router.step import PromptScores, SampledToken, ScheduledChunk, StepPlan, StepResult

# A waiting request is deferred for a sibling's prefill only when they share at least this many
# prompt tokens (or all of a shorter prompt): a short overlap costs less to compute twice than a wait.
MIN_SHARED_PREFILL_TOKENS = 256
# TGI's batching hold (max_waiting_tokens / waiting_served_ratio) spares the running decodes from
# frequent prefills. A waiting request whose prompt is mostly cached (a chat's next turn, a shared
# system prompt) has a short prefill, at most this many tokens: it is held for fewer decode steps.
MAX_UNHELD_PREFILL_TOKENS = 512
# ... at most this many. Not zero: a step with any prefill runs eager, not as a CUDA graph (Llama-3-8B
# at 64 rows: ~17 ms against ~7 ms), and 64 chat conversations send a next turn every ~2 decode steps,
# so admitting each at once made nearly every step an eager one (multi-turn chat at 64 conversations:
# 3,291 output tok/s, ~19 ms a step). Held this long, one eager step admits ~4 turns. A step-level
# model of that replay (an eager step 10-15 ms dearer) gives, against no hold, +3% throughput at 4
# steps, +9-11% at 8, +11-14% at 12, and TTFT p50 21 -> 47 / 46 / 70 ms: 8. The hold adds at most
# this many decode steps to a turn's TTFT.
SHORT_PREFILL_HOLD_STEPS = 8
# A request whose scores went NaN (a model overflow, or parameters f32 turns into inf) ends with this
# generation error rather than emit the token argmax picks from NaNs (the first NaN's id, garbage).
NAN_SCORES = "the scores of the next token are NaN"


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_batch_prefill_tokens: int
    admission: AdmissionLimits
    # TGI's batching: while the running batch decodes, waiting requests join it once at least
    # waiting_served_ratio x its size of them wait, or after max_waiting_tokens decode steps
    # without an admission; a few late requests do not interrupt every decode step with a prefill.
    # 0 and 0.0: admit at every step.
    max_waiting_tokens: int = 0
    waiting_served_ratio: float = 0.0


class Scheduler:
    def __init__(
        self,
        pool: KVSlotPool,
        limits: SchedulerLimits,
        eos_token_ids: frozenset[int],
        lora_slots: LoraSlots | None = None,  # None: LoRA off
    ) -> None:
        self.pool = pool
        self.lora_slots = lora_slots
        self.limits = limits
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first: the tail is preempted first
        self.requests: dict[str, Request] = {}
        self._abort_ids: set[str] = set()
        self._decode_steps_since_admission = 0
        # Requests here whose sampling reads their own tokens on the host (no overlap scheduling then)
        self.num_reading_own_tokens = 0
        # Grammar-constrained requests here (their steps sample after the previous step's update)
        self.num_constrained = 0
        # Prefix caching: running requests whose prompt is not all published to the cache yet, and
        # the waiting requests deferred for one of them (-> that one, tokens they share).
        self._prefilling: list[Request] = []
        self._deferred: dict[Request, tuple[Request, int]] = {}

    # ---- queue management -------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.num_reading_own_tokens += request.reads_own_tokens_to_sample
        self.num_constrained += request.params.grammar is not None

    def abort(self, request_id: str) -> None:
        """Takes effect at the next schedule(): the request's slots are free after it."""
        if request_id in self.requests:
            self._abort_ids.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- schedule ---------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan(aborted=self._apply_aborts())
        budget = self.limits.max_batch_prefill_tokens
        if self._schedule_decodes(plan):
            self._decode_steps_since_admission += 1
            if self._admission_is_due():
                self._admit_waiting(plan, budget)
            return plan
        index = 0
        while index < len(self.running):
            request = self.running[index]
            chunk = self._schedule_running(request, budget, plan)
            if chunk is None and request.status is not RequestStatus.RUNNING:
                break  # it preempted itself: nothing newer is left to schedule
            if chunk is not None:
                plan.chunks.append(chunk)
                budget -= _prefill_tokens(chunk)
            index += 1
        if not plan.preempted:  # after a preemption the pool is tight: admit nobody this step
            self._admit_waiting(plan, budget)
        return plan

    def _admission_is_due(self) -> bool:
        """Between decode steps: enough requests wait, or they have waited max_waiting_tokens steps,
        or (prefix caching) the first one in the queue has a short prefill after its cached prefix and
        SHORT_PREFILL_HOLD_STEPS have passed."""
        limits = self.limits
        if len(self.waiting) >= int(len(self.running) * limits.waiting_served_ratio):
            return True
        steps = self._decode_steps_since_admission
        if steps >= limits.max_waiting_tokens:
            return True
        cache = self.pool.prefix_cache
        return (
            cache is not None
            and steps >= SHORT_PREFILL_HOLD_STEPS
            and bool(self.waiting)
            and _has_a_short_cached_prefill(cache, self.waiting[0])
        )

    def _schedule_decodes(self, plan: StepPlan) -> bool:
        """The usual step: every running request decodes one token and the pool has a slot for each.

        Takes all the slots at once, in the order one-by-one allocation would hand them out, and
        schedules every running request; False (nothing done) when some request is not a plain
        decode or the pool is too tight, which the general loop handles (chunks, preemption).

        A request whose pending token is its last by length (overlap scheduling) is left out, as the
        general loop leaves it: update() finishes it. The step stays a decode step, so admission keeps
        its hold; otherwise every answer that ends at max_new_tokens let the waiting requests in at
        once (a chat replay at 128 conversations: half the steps prefilled, eager on a GPU).
        """
        running = self.running
        if not running or self.pool.num_free_slots < len(running):
            return False
        decoding = []
        for request in running:
            if request.num_computed_tokens == 0 or request.num_new_tokens != 1:
                return False
            if not _at_length_cap(request):
                decoding.append(request)
        if not decoding:
            return False  # nothing decodes: the general loop admits the waiting requests at once
        slots = self.pool.allocate(len(decoding))
        assert slots is not None  # checked above: the pool has a free slot for each
        chunk = self._chunk
        plan.chunks = [chunk(request, 1, [slot]) for request, slot in zip(decoding, reversed(slots))]
        return True

    def _schedule_running(self, request: Request, budget: int, plan: StepPlan) -> ScheduledChunk | None:
        if _at_length_cap(request):
            return None  # its pending token is its last: update() finishes it
        num_new = request.num_new_tokens
        if request.num_computed_tokens == 0 or num_new > 1:  # a (re-)prefill chunk
            num_new = min(num_new, budget)
        if num_new <= 0:
            return None
        while (slots := self.pool.allocate(num_new)) is None:
            victim = self.running[-1]
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is request:
                return None
        return self._chunk(request, num_new, slots)

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        running_tokens = [_tokens(r) for r in self.running]
        pool, waiting = self.pool, self.waiting
        index = 0
        while index < len(waiting):
            request = waiting[index]
            if self._prefilling and self._is_deferred(request):
                index += 1  # it keeps its place; the requests behind it may start
                continue
            admission = self.limits.admission
            if not can_admit(
                running_tokens, _tokens(request), admission, pool.num_used_slots, budget, pool.num_shared_slots
            ):
                return  # FIFO: nobody overtakes a request that does not fit
            row = pool.allocate_row()
            if row is None:
                return
            if pool.prefix_cache is not None:
                self._take_cached_prefix(request)
            num_new = min(request.num_new_tokens, budget)
            slots = pool.allocate(num_new)
            if slots is None:
                pool.free_row(row)
                self._release(request)  # gives back a cached prefix it took
                request.num_computed_tokens = 0
                return
            if request.lora_id and not self._place_adapter(request, plan):
                pool.free(slots)
                pool.free_row(row)
                self._release(request)
                request.num_computed_tokens = 0
                return  # every adapter slot is held by other adapters' running requests
            del waiting[index]
            self._decode_steps_since_admission = 0
            request.row, request.status = row, RequestStatus.RUNNING
            self.running.append(request)
            running_tokens.append(_tokens(request))
            if pool.prefix_cache is not None and not request.output_ids and not request.needs_prompt_logprobs:
                self._prefilling.append(request)  # (one scoring its prompt bypasses the cache: nobody waits for it)
            if request.cached_prefix is not None:
                plan.cached_prefixes.append((row, request.cached_prefix.slots))
            chunk = self._chunk(request, num_new, slots)
            plan.chunks.append(chunk)
            budget -= _prefill_tokens(chunk)

    def _place_adapter(self, request: Request, plan: StepPlan) -> bool:
        assert self.lora_slots is not None  # the engine takes no LoRA request without them
        placed = self.lora_slots.acquire(request.lora_id)
        if placed is None:
            return False
        request.lora_slot, is_new = placed
        if is_new:
            plan.lora_loads.append((request.lora_slot, request.lora_id))
        return True

    def _is_deferred(self, request: Request) -> bool:
        """True while a running request is prefilling a long prefix of `request`'s prompt that is not
        in the cache yet: `request` then takes it from the cache once published instead of computing
        it too. A sibling that is preempted, aborted or finishes leaves `_prefilling`, which ends the wait."""
        if request.output_ids or request.needs_prompt_logprobs:
            return False  # a resumed request goes first; a scoring one computes its whole prompt anyway
        deferred = self._deferred.get(request)
        if deferred is not None:
            sibling, num_shared = deferred
            if sibling in self._prefilling and _is_worth_waiting_for(sibling, num_shared, request):
                return True
        prompt = request.params.prompt_ids
        for sibling in self._prefilling:
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

    def _take_cached_prefix(self, request: Request) -> None:
        """Start `request` past the longest cached prefix of its tokens. The last token is always
        computed (its logits give the next token); a request scoring its prompt computes all of it."""
        request.num_kv_written = 0
        if request.needs_prompt_logprobs:
            return
        prefix = self.pool.take_cached_prefix(request.cache_ids(request.num_tokens - 1))
        if prefix is not None:
            request.cached_prefix, request.slots = prefix, list(prefix.slots)
            request.num_computed_tokens = request.num_kv_written = prefix.num_tokens
        self._deferred.pop(request, None)
        if not request.output_ids:
            request.num_cached_prompt_tokens = 0 if prefix is None else prefix.num_tokens

    def _chunk(self, request: Request, num_new: int, slots: list[int]) -> ScheduledChunk:
        start = request.num_computed_tokens
        request.num_computed_tokens = start + num_new
        request.slots.extend(slots)
        prompt_rows = None
        if request.needs_prompt_logprobs:  # positions start.. score prompt tokens start+1..
            prompt_rows = max(0, min(start + num_new, request.num_prompt_tokens - 1) - start)
            if prompt_rows == 0 and start > 0:
                prompt_rows = None  # past the prompt (its scores may be still in flight): nothing to score
        return ScheduledChunk(
            request=request,
            start=start,
            num_tokens=num_new,
            slots=slots,
            is_sampled=start + num_new == request.num_tokens,
            num_prompt_logprob_rows=prompt_rows,
        )

    # ---- update -----------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> list[TokenEvent]:
        events = [TokenEvent(r.request_id, finish_reason=FinishReason.ABORT.value) for r in plan.aborted]
        scores = result.prompt_scores or [None] * len(plan.chunks)
        for chunk, sampled, prompt_scores in zip(plan.chunks, result.tokens, scores):
            request = chunk.request
            if request.is_finished:
                continue
            error = result.errors.get(request.request_id)
            if error is None and sampled is not None and sampled.logprob != sampled.logprob:
                error = NAN_SCORES  # no token to read from the row: it held a NaN, so its chosen logprob is NaN
            if error is not None:
                self.finish(request, FinishReason.ERROR)
                events.append(TokenEvent(request.request_id, finish_reason="error", error=error))
                continue
            request.num_kv_written = chunk.end  # (only read with prefix caching, reset on admission)
            if prompt_scores is not None and request.status is RequestStatus.RUNNING:
                # (a request preempted since this step was scheduled re-scores its whole prompt)
                _record_prompt_scores(request, chunk.start, prompt_scores)
            if chunk.is_sampled:
                assert sampled is not None, f"chunk of {request.request_id} was sampled but has no token"
                events.append(self._append_token(request, sampled))
            elif request in self._prefilling and request.status is RequestStatus.RUNNING:
                self._publish_prefix(request)  # a prefill chunk: waiters may take it from the cache now
        return events

    def tokens_in_flight(self, plan: StepPlan, sampled_chunks: list[int]) -> None:
        """Overlap scheduling: `plan` is launched and the next step will be scheduled before its
        update(); the tokens sampled for chunks `sampled_chunks` stay on the device until then."""
        chunks = plan.chunks
        for chunk_index in sampled_chunks:
            chunks[chunk_index].request.num_pending_tokens += 1

    def _append_token(self, request: Request, sampled: SampledToken) -> TokenEvent:
        output_ids, params, token_id = request.output_ids, request.params, sampled.token_id
        if request.num_pending_tokens:  # this token was the one in flight
            request.num_pending_tokens -= 1
        output_ids.append(token_id)
        event = TokenEvent(
            params.request_id,
            [token_id],
            [sampled.logprob],
            [sampled.top_tokens] if params.sampling.top_n_tokens > 0 else [],
            seed=request.seed,
        )
        # Most tokens are neither a request's first nor a candidate for its last: skip both checks.
        num_output = len(output_ids)
        may_stop = token_id in self.eos_token_ids or token_id in params.stop_token_ids
        if num_output == 1 or num_output >= params.max_new_tokens or may_stop:
            self._first_or_last_token(request, token_id, event)
        return event

    def _first_or_last_token(self, request: Request, token_id: int, event: TokenEvent) -> None:
        if len(request.output_ids) == 1:
            event.num_prompt_tokens = request.num_prompt_tokens
            event.num_cached_tokens = request.num_cached_prompt_tokens
            if self.pool.prefix_cache is not None and request.status is RequestStatus.RUNNING:
                self._publish_prefix(request)
                if request in self._prefilling:
                    self._prefilling.remove(request)
            if request.params.prompt_logprobs:
                event.prompt_logprobs = list(request.prompt_logprobs)
                if request.params.sampling.top_n_tokens > 0:
                    event.prompt_top_tokens = [list(t) for t in request.prompt_top_tokens]
        reason = self._stop_reason(request, token_id)
        if reason is not None:
            self.finish(request, reason)
            event.finish_reason = reason.value

    def _stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        params = request.params  # TGI's order: length first, then EOS, then stop ids
        if len(request.output_ids) >= params.max_new_tokens:
            return FinishReason.LENGTH
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.EOS_TOKEN
        if token_id in params.stop_token_ids:
            return FinishReason.STOP_TOKEN
        return None

    # ---- freeing ----------------------------------------------------------------------
    def finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        self._deferred.pop(request, None)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        if self.requests.pop(request.request_id, None) is not None:
            self.num_reading_own_tokens -= request.reads_own_tokens_to_sample
            self.num_constrained -= request.params.grammar is not None
        self._abort_ids.discard(request.request_id)

    def _apply_aborts(self) -> list[Request]:
        aborted = [self.requests[i] for i in self._abort_ids if i in self.requests]
        for request in aborted:
            self.finish(request, FinishReason.ABORT)
        self._abort_ids.clear()
        return aborted

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        if request.needs_prompt_logprobs:  # partial scores are recomputed with the re-prefill
            request.prompt_logprobs.clear()
            request.prompt_top_tokens.clear()
        self.waiting.appendleft(request)

    def _publish_prefix(self, request: Request) -> None:
        """Cache the tokens of a running request whose K/V completed steps wrote (each prefill chunk,
        then its whole prompt), so that requests sharing them (n / best_of siblings, a common system
        prompt) hit while this one still runs."""
        tokens = request.cache_ids(request.num_kv_written)
        request.cached_prefix = self.pool.share_running(tokens, request.slots, request.cached_prefix)

    def _release(self, request: Request) -> None:
        if self.pool.prefix_cache is None:
            self.pool.free(request.slots)
        else:  # only tokens whose K/V a completed step wrote are cached (never a token in flight)
            if request in self._prefilling:
                self._prefilling.remove(request)
            prefix = request.cached_prefix
            num_cached = max(min(request.num_kv_written, len(request.slots)), prefix.num_tokens if prefix else 0)
            self.pool.cache_and_free(request.cache_ids(num_cached), request.slots, prefix)
            request.cached_prefix, request.num_kv_written = None, 0
        request.slots = []
        if request.lora_slot >= 0:
            assert self.lora_slots is not None  # a slot was taken from them
            self.lora_slots.release(request.lora_slot)
            request.lora_slot = -1
        if request.row is not None:
            self.pool.free_row(request.row)
            request.row = None


def _prefill_tokens(chunk: ScheduledChunk) -> int:
    """Tokens a chunk takes from the step's prefill budget (decodes take none)."""
    is_decode = chunk.num_tokens == 1 and chunk.start > 0 and chunk.is_sampled
    return 0 if is_decode else chunk.num_tokens


def _has_a_short_cached_prefill(cache: PrefixCache, request: Request) -> bool:
    """Most of the prompt is cached and what is left is short (MAX_UNHELD_PREFILL_TOKENS)."""
    if request.output_ids or request.needs_prompt_logprobs:
        return False
    prompt = request.params.prompt_ids
    num_cached = min(cache.matched_length(request.cache_ids(len(prompt))), len(prompt) - 1)
    num_new = len(prompt) - num_cached
    return num_new <= min(num_cached, MAX_UNHELD_PREFILL_TOKENS)


def _is_worth_waiting_for(sibling: Request, num_shared: int, request: Request) -> bool:
    """`request` shares `num_shared` leading prompt tokens with `sibling`, which is prefilling them:
    wait while some are not published yet, if they are a long prefix (or all but the last token of
    a short prompt: `n` siblings)."""
    return num_shared > sibling.num_kv_written and num_shared >= min(
        MIN_SHARED_PREFILL_TOKENS, request.num_prompt_tokens - 1
    )


def _at_length_cap(request: Request) -> bool:
    """Its newest token, still on the device, is its last (only ever true with a pending token)."""
    return request.num_output_tokens >= request.params.max_new_tokens


def _tokens(request: Request) -> RequestTokens:
    params, prefix = request.params, request.cached_prefix
    return RequestTokens(
        request.num_prompt_tokens,
        len(request.output_ids),
        params.max_new_tokens,
        params.ignore_eos,
        0 if prefix is None else prefix.num_tokens,
    )


def _record_prompt_scores(request: Request, start: int, scores: PromptScores) -> None:
    if start == 0:
        request.prompt_logprobs.append(None)
        request.prompt_top_tokens.append([])
    request.prompt_logprobs.extend(scores.logprobs)
    if request.params.sampling.top_n_tokens > 0:
        request.prompt_top_tokens.extend(scores.top_tokens)
