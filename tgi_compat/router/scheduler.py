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
A prompt's K/V is published to the cache chunk by chunk as its prefill steps complete, and a waiting
request sharing a long prefix with it waits for that (tgi_compat/router/prefill_waits.py). Between decode
steps, TGI's batching hold decides when the waiting requests join (tgi_compat/router/batching_hold.py).

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
from typing import TYPE_CHECKING

from tgi_compat.router.admission import AdmissionLimits, can_admit, images_fit
from tgi_compat.router.batching_hold import BatchingHold
from tgi_compat.router.client_api import Refusal, RequestRejectedError
from tgi_compat.router.kv_slots import KVSlotPool
from tgi_compat.router.lora_slots import LoraSlots
from tgi_compat.router.outputs import TokenEvent
from tgi_compat.router.prefill_waits import PrefillWaits
from tgi_compat.router.request import FinishReason, Request, RequestStatus
from tgi_compat.router.step import SampledToken, ScheduledChunk, StepPlan, StepResult
from tgi_compat.router.stopping import admission_tokens, is_at_length_cap, stop_reason

if TYPE_CHECKING:
    from tgi_compat.router.speculative.speculator import Speculator

# A request whose scores went NaN (a model overflow, or parameters f32 turns into inf) ends with this
# generation error rather than emit the token argmax picks from NaNs (the first NaN's id, garbage).
NAN_SCORES = "the scores of the next token are NaN"


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_batch_prefill_tokens: int
    admission: AdmissionLimits
    # TGI's batching hold (tgi_compat/router/batching_hold.py); 0 and 0.0: admit at every step.
    max_waiting_tokens: int = 0
    waiting_served_ratio: float = 0.0
    # a cross-attending model's images whose keys running requests may hold (CrossAttentionKeys.max_images)
    max_cross_images: int | None = None
    # prompt tokens in a step that also decodes (Sarathi-Serve's chunk budget): every running stream waits for that
    # step, so less keeps their inter-token latency down while prompts join; None: max_batch_prefill_tokens
    max_mixed_prefill_tokens: int | None = None

    def prefill_budget(self, decoding: bool) -> int:
        """New prompt tokens a step may take; `decoding`: it also decodes for running requests."""
        full, mixed = self.max_batch_prefill_tokens, self.max_mixed_prefill_tokens
        return min(full, mixed) if decoding and mixed is not None else full


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
        self._hold = BatchingHold(
            limits.max_waiting_tokens, limits.waiting_served_ratio, capped=limits.max_mixed_prefill_tokens is not None
        )
        # Requests here whose sampling reads their own tokens on the host (no overlap scheduling then)
        self.num_reading_own_tokens = 0
        # Grammar-constrained requests here (their steps sample after the previous step's update)
        self.num_constrained = 0
        self._prefill_waits = PrefillWaits()  # prefix caching: who waits for whose prefill
        self.speculator: Speculator | None = None  # speculative decoding (set by the engine), None: off

    # ---- queue management -------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise RequestRejectedError(Refusal.DUPLICATE_ID, request.request_id)
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
    def schedule(self, drafts: bool = True) -> StepPlan:
        """The next step's plan; `drafts`: the speculator may add drafts (every token is on the host)."""
        plan = StepPlan(aborted=self._apply_aborts())
        if self._schedule_decodes(plan):
            if self._hold.decode_step_is_due(self.waiting, len(self.running), self.pool.prefix_cache):
                self._admit_waiting(plan, self.limits.prefill_budget(decoding=True))
                self._hold.released(self.waiting)
            if self.speculator is not None and drafts:
                self.speculator.add_drafts(plan, self.pool)
            return plan
        budget = self.limits.prefill_budget(any(_decodes(r) and not is_at_length_cap(r) for r in self.running))
        index = 0
        while index < len(self.running):
            request = self.running[index]
            chunk = self._schedule_running(request, budget, plan)
            if chunk is None and request.status is not RequestStatus.RUNNING:
                break  # it preempted itself: nothing newer is left to schedule
            if chunk is not None:
                plan.chunks.append(chunk)
                budget -= chunk.prefill_tokens
            index += 1
        if not plan.preempted:  # after a preemption the pool is tight: admit nobody this step
            self._admit_waiting(plan, budget)
        if self.speculator is not None and drafts and not plan.preempted:
            self.speculator.add_drafts(plan, self.pool)
        return plan

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
            if not _decodes(request):
                return False
            if not is_at_length_cap(request):
                decoding.append(request)
        if not decoding:
            return False  # nothing decodes: the general loop admits the waiting requests at once
        slots = self.pool.allocate(len(decoding))
        assert slots is not None  # checked above: the pool has a free slot for each
        chunk = self._chunk
        plan.chunks = [chunk(request, 1, [slot]) for request, slot in zip(decoding, reversed(slots))]
        return True

    def _schedule_running(self, request: Request, budget: int, plan: StepPlan) -> ScheduledChunk | None:
        if is_at_length_cap(request):
            return None  # its pending token is its last: update() finishes it
        num_new = request.num_new_tokens
        if request.num_computed_tokens == 0 or num_new > 1:  # a (re-)prefill chunk
            num_new = request.prefill_chunk_size(budget)
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
        running_tokens = [admission_tokens(r) for r in self.running]
        pool, waiting = self.pool, self.waiting
        index = 0
        while index < len(waiting):
            request = waiting[index]
            if self._prefill_waits.prefilling and self._prefill_waits.is_deferred(request):
                index += 1  # it keeps its place; the requests behind it may start
                continue
            admission = self.limits.admission
            if not can_admit(
                running_tokens, admission_tokens(request), admission, pool.num_used_slots, budget, pool.num_shared_slots
            ):
                return  # FIFO: nobody overtakes a request that does not fit
            max_images = self.limits.max_cross_images
            held = [] if max_images is None else [len(r.params.images) for r in self.running]
            if not images_fit(held, len(request.params.images), max_images):
                return  # its image keys wait for room, as its KV does
            row = pool.allocate_row()
            if row is None:
                return
            if pool.prefix_cache is not None:
                self._take_cached_prefix(request)
            num_new = request.prefill_chunk_size(budget)
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
            self._hold.admitted()
            request.row, request.status = row, RequestStatus.RUNNING
            self.running.append(request)
            running_tokens.append(admission_tokens(request))
            if pool.prefix_cache is not None and not request.output_ids and not request.needs_prompt_logprobs:
                self._prefill_waits.prefilling.append(
                    request
                )  # (one scoring its prompt bypasses the cache: nobody waits for it)
            if request.cached_prefix is not None:
                plan.cached_prefixes.append((row, request.cached_prefix.slots))
            chunk = self._chunk(request, num_new, slots)
            plan.chunks.append(chunk)
            budget -= chunk.prefill_tokens

    def _place_adapter(self, request: Request, plan: StepPlan) -> bool:
        assert self.lora_slots is not None  # the engine takes no LoRA request without them
        placed = self.lora_slots.acquire(request.lora_id)
        if placed is None:
            return False
        request.lora_slot, is_new = placed
        if is_new:
            plan.lora_loads.append((request.lora_slot, request.lora_id))
        return True

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
        self._prefill_waits.forget(request)
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
        if self.speculator is not None and result.aux_hidden is not None:  # (EAGLE-3 reads them)
            self.speculator.observe(plan, result.aux_hidden)
        scores = result.prompt_scores or [None] * len(plan.chunks)
        for index, (chunk, sampled, prompt_scores) in enumerate(zip(plan.chunks, result.tokens, scores)):
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
                request.record_prompt_scores(chunk.start, prompt_scores.logprobs, prompt_scores.top_tokens)
            if chunk.is_sampled:
                assert sampled is not None, f"chunk of {request.request_id} was sampled but has no token"
                if chunk.drafts:
                    assert self.speculator is not None  # it made the drafts
                    verified = [sampled, *result.verified[index]]
                    events += self.speculator.accept(chunk, verified, self._append_token, self.pool)
                else:
                    events.append(self._append_token(request, sampled))
            elif request in self._prefill_waits.prefilling and request.status is RequestStatus.RUNNING:
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
        if request.healing is not None:
            request.healing.push(token_id)
        # Most tokens are neither a request's first nor a candidate for its last: skip both checks
        # (healing only adds to max_new_tokens, so it is the lower bound of the length budget).
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
                self._prefill_waits.published_all(request)
            if request.params.prompt_logprobs:
                event.prompt_logprobs = list(request.prompt_logprobs)
                if request.params.sampling.top_n_tokens > 0:
                    event.prompt_top_tokens = [list(t) for t in request.prompt_top_tokens]
        reason = stop_reason(request, token_id, self.eos_token_ids)
        if reason is not None:
            self.finish(request, reason)
            event.finish_reason = reason.value
            if self.speculator is not None:
                event.num_skipped_tokens = self.speculator.num_accepted(request)

    # ---- freeing ----------------------------------------------------------------------
    def finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        self._prefill_waits.forget(request)
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
            self._prefill_waits.published_all(request)
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


def _decodes(request: Request) -> bool:
    """Its next step computes one token past its prompt (not a prefill chunk)."""
    return request.num_computed_tokens > 0 and request.num_new_tokens == 1
