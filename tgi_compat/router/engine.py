"""EngineCore: one step = schedule -> execute -> update.

With overlap scheduling (on for CUDA) the host does not wait for a step before preparing the next:

    step N:   schedule N -> launch N -> [wait for N-1 -> update N-1] -> return N-1's events
                            GPU: ...N-1 | N .................. (N+1 is queued before N ends)

Step N's plan counts the tokens of step N-1 as pending (Request.num_pending_tokens) and takes them
as inputs on the device (the executor maps each to its output row of N-1); a request that finished at N-1 (EOS, a stop id) still runs in step N,
whose token for it is dropped. Requests whose sampling reads their own tokens on the host
(penalties, watermark, healing) turn it off while any is in the engine.

Grammar-constrained requests keep it on, with the sampling of step N deferred past its forward:

    step N:   schedule N -> launch forward N -> [wait for N-1 -> matchers accept N-1 -> update N-1]
              -> fill N's masks (the host, while the GPU runs forward N) -> queue sampling N

A request with a grammar waits outside the scheduler until its grammar is compiled (tgi_compat/router/sampling/grammar.py),
so a slow compile holds up nobody else.

Keep this file minimal. Scheduling lives in scheduler.py, batch building and failure isolation in
executor.py, token selection in sampling/ (one TokenSelector, which the executor owns), checks in
validation.py; a feature that needs engine logic goes there, not here.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch

from tgi_compat.modeling.forward_batch import PREFIX_GROUP_MAX
from tgi_compat.router.admission import AdmissionLimits
from tgi_compat.router.client_api import EngineInfo, Refusal, RequestRejectedError
from tgi_compat.router.config import EngineConfig
from tgi_compat.router.cross_attention import CrossAttentionStore
from tgi_compat.router.engine_stats import EngineStatsTracker
from tgi_compat.router.executor import LaunchedStep, StepExecutor
from tgi_compat.router.image_cache import EncoderCache, ImageEncoder
from tgi_compat.router.kv_slots import KVSlotPool
from tgi_compat.router.lora_calls import AdapterCalls
from tgi_compat.router.lora_registry import LoraRegistry
from tgi_compat.router.outputs import TokenEvent
from tgi_compat.router.request import GenerateRequest, Request
from tgi_compat.router.runner_api import Runner
from tgi_compat.router.sampling.grammar_compile import CompileLimits
from tgi_compat.router.sampling.selector import SelectionConfig
from tgi_compat.router.scheduler import Scheduler, SchedulerLimits
from tgi_compat.router.speculative.eagle3 import Eagle3Drafter
from tgi_compat.router.speculative.speculator import Speculator
from tgi_compat.router.stats import EngineStats
from tgi_compat.router.step import StepPlan, StepResult
from tgi_compat.router.stopping import HealingCount
from tgi_compat.router.validation import validate_request

if TYPE_CHECKING:
    from tgi_compat.modeling.config import ModelConfig
    from tgi_compat.modeling.lora.manager import LoraManager
    from tgi_compat.modeling.vision.cross_keys import CrossAttentionKeys

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        model_config: ModelConfig,
        lora: LoraManager | None = None,
        image_encoder: ImageEncoder | None = None,  # a vision model's (tgi_compat.modeling.vision.encoder)
        drafter: Eagle3Drafter | None = None,  # speculation's EAGLE-3 head (model_loading.load_drafter)
        cross_attention: CrossAttentionKeys | None = None,  # a cross-attending vision model's (Mllama)
    ) -> None:
        self.config = config
        self.info = engine_info(config, runner, model_config)
        limits = SchedulerLimits(
            max_batch_prefill_tokens=config.max_batch_prefill_tokens,
            admission=AdmissionLimits(
                num_kv_slots=runner.num_kv_slots,
                max_running_requests=config.max_running_requests,
                router_token_ratio=config.router_token_ratio,
                router_max_new_token_len=config.router_max_new_token_len,
            ),
            max_waiting_tokens=config.max_waiting_tokens,
            waiting_served_ratio=config.waiting_served_ratio,
            max_cross_images=None if cross_attention is None else cross_attention.max_images,
            max_mixed_prefill_tokens=config.max_mixed_prefill_tokens,
        )
        # a cross-attending model's text before its first image reads every image, which the prefix cache's keys
        # (image_keyed_ids) do not tell apart: no prefix cache for it, as TGI has none for any vision model
        prefix_caching = config.prefix_caching and cross_attention is None
        self.pool = KVSlotPool(runner.num_kv_slots, config.max_running_requests, prefix_caching)
        self.lora = None if lora is None else LoraRegistry(lora, config.max_cpu_loras, self._adapter_in_use)
        lora_slots = None if self.lora is None else self.lora.slots
        self.scheduler = Scheduler(self.pool, limits, frozenset(self.info.eos_token_ids), lora_slots)
        images = None
        if image_encoder is not None:
            images = EncoderCache(
                image_encoder, config.image_cache_capacity, config.image_cache_reserved_ratio, config.image_cache_bytes
            )
        self.image_cache = images
        self.cross_attention = None
        if images is not None and cross_attention is not None:  # its images are keys, not placeholder rows
            self.cross_attention = CrossAttentionStore(images, cross_attention.projector)
        # --diverse_mode: decode steps group the rows that run on one cached prefix (siblings) for the shared-prefix kernel
        group_max = PREFIX_GROUP_MAX if config.diverse_mode and config.prefix_caching else 0
        selection = selection_config(config, self.info)
        aux_rows = None if drafter is None else drafter.aux_rows
        self.executor = StepExecutor(
            runner,
            selection,
            self.lora is not None,
            images if self.cross_attention is None else None,
            prefix_group_max=group_max,
            aux_rows=aux_rows,
            cross=self.cross_attention,
        )
        self.selector = self.executor.selector
        self.stats = EngineStatsTracker(self.scheduler, lora_names=None if self.lora is None else self.lora.name_of)
        self.stats.group_counts = self.executor.batch_builder.group_counts
        overlap = config.overlap_scheduling
        self.overlap_scheduling = self.info.device.startswith("cuda") if overlap is None else overlap
        if config.speculative is not None:  # a step's drafts are made from the tokens of the step before, on the host:
            # such steps run without overlap; those where the step-cost table turns drafts off keep it
            self.scheduler.speculator = Speculator(config.speculative, drafter)
        self._in_flight: LaunchedStep | None = None  # launched, not yet updated (overlap scheduling)
        self._pending_events: list[TokenEvent] = []  # final events of requests that never reached the scheduler
        self._rng = random.Random(config.seed)
        self._num_arrivals = 0
        for adapter in config.lora_adapters:
            self.load_adapter(adapter.name, adapter.source, adapter.revision)
        self.adapter_calls = AdapterCalls(self.lora)  # loads and unloads while serving (every rank's)
        if self.lora is not None:
            loaded = dict(self.lora.sources)
            self.info = dataclasses.replace(self.info, max_loras=self.lora.slots.num_slots, lora_adapters=loaded)

    @classmethod
    def from_config(cls, config: EngineConfig, count_step: Callable[[], None] | None = None) -> EngineCore:
        """Load the model named by the config (tgi_compat.modeling.runner) and build the engine around it.
        count_step: called per step sent to the other tensor-parallel ranks (tgi_compat.router.rank_heartbeat)."""
        from tgi_compat.router.model_loading import fit_to_runner, load_drafter, load_runner

        runner = load_runner(config, count_step=count_step)
        config = fit_to_runner(config, runner)
        drafter = load_drafter(config, runner)
        model = runner.model_config
        return cls(config, runner, model, runner.lora, runner.image_encoder, drafter, runner.cross_attention)

    def close(self) -> None:
        """Release what lives beyond this process: the other tensor-parallel ranks, the grammar compiler."""
        self.selector.close()
        self.adapter_calls.close()
        self.executor.runner.close()

    def add_request(self, params: GenerateRequest) -> None:
        """Validate (RequestRejectedError) and queue; the request waits for admission."""
        validate_request(params, self.info)
        seed = None
        if params.sampling.is_sampling:
            seed = params.sampling.seed if params.sampling.seed is not None else self._rng.getrandbits(64)
        request = Request(params, arrival=self._num_arrivals, seed=seed)
        if params.healing_prefix:
            max_uncounted = self.info.max_total_tokens - len(params.prompt_ids) - params.max_new_tokens
            request.healing = HealingCount(self.selector.healing_table(), params.healing_prefix.encode(), max_uncounted)
        if params.adapter_id is not None:
            if self.lora is None:
                raise RequestRejectedError(Refusal.LORA_OFF, params.adapter_id)
            request.lora_id = self.lora.resolve(params.adapter_id)
        self._num_arrivals += 1
        if self.image_cache is not None and params.images:
            self.image_cache.prefetch(params.images)  # decoded and processed on host threads while it waits
        if self.selector.add(request):  # else it joins the scheduler once its grammar compiled
            self.scheduler.add(request)

    def load_adapter(self, name: str, source: str, revision: str | None = None, replace: bool = False) -> None:
        """Load a LoRA adapter while serving, with `replace` in place of the one of that name (ValueError,
        LoraAdapterError: the reason, nothing changed)."""
        if self.lora is None:
            raise ValueError("LoRA is off: start the server with --enable-lora or --lora-adapters")
        self.lora.load(name, source, revision, replace)

    def unload_adapter(self, name: str) -> None:
        """LookupError when it is not loaded."""
        if self.lora is None:
            raise ValueError("LoRA is off: no adapter is loaded")
        self.lora.unload(name)

    def _adapter_in_use(self, adapter_id: int) -> bool:
        return any(r.lora_id == adapter_id for r in self.scheduler.requests.values())

    def abort(self, request_id: str) -> None:
        if (event := self.selector.abort(request_id)) is not None:
            self._pending_events.append(event)
        else:
            self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        compiling = self.selector.num_waiting > 0
        return self.scheduler.has_unfinished() or self._in_flight is not None or compiling or bool(self._pending_events)

    def step(self) -> list[TokenEvent]:
        """Plain: schedule, execute and update one step, and return its events. With overlap
        scheduling: schedule and launch a step, then complete the one in flight and return its events.

        Ordering invariant (overlap): schedule(N) -> launch(N, previous=N-1) -> update(N-1) ->
        tokens_in_flight(N). N is scheduled while N-1's tokens are pending and launched before
        N-1 is updated, so its pending inputs are read from N-1's sampled ids on the device; N-1
        is updated before N's tokens are counted, so a request has at most one pending token when
        a step is scheduled, and it is always in the step just before.
        """
        events = self._take_compiled() if self.selector.num_waiting or self._pending_events else []
        previous, self._in_flight = self._in_flight, None
        speculator = self.scheduler.speculator
        overlap = (
            self.overlap_scheduling
            and not self.scheduler.num_reading_own_tokens
            and (speculator is None or not speculator.may_pay(self.scheduler.running))
        )
        if previous is not None and not overlap:  # the next plan needs every token on the host
            events += self._complete(previous)
            previous = None
        plan = self.scheduler.schedule(drafts=not overlap)
        if overlap and not plan.is_empty:
            constrained = self.scheduler.num_constrained > 0
            completed: list[TokenEvent] = []

            def complete_previous() -> None:
                # A step that encodes images queues the encoder's hundreds of kernels before its forward: queued behind
                # them, the forward's launches would block the host until the device had run most of the encoder,
                # and the step before's first tokens (done long before) would wait with them. So the step before is
                # completed here, once the encoder is queued and before the forward is (TTFT, session 28).
                nonlocal previous
                if previous is not None:
                    completed.extend(self._complete(previous))
                    previous = None

            launched: LaunchedStep | None = None
            try:
                launched = self.executor.launch(
                    plan, previous, defer_sampling=constrained, after_images=None if constrained else complete_previous
                )
            except Exception:  # run it again below, where failures are contained
                logger.exception("launching a step of %d requests failed; running it synchronously", len(plan.chunks))
            events += completed
            if launched is not None:
                if previous is not None:
                    events += self._complete(previous)
                if constrained and not self._sample_deferred(launched):
                    return events + self._execute(plan)
                self.scheduler.tokens_in_flight(plan, launched.sampled_chunks)
                self._in_flight = launched
                return events
        if previous is not None:
            events += self._complete(previous)
        return events + self._execute(plan)

    def _sample_deferred(self, launched: LaunchedStep) -> bool:
        """Queue the sampling of a constrained step once the matchers have accepted the tokens of the
        step before it; False when that fails (the step then runs again where failures are contained:
        its forward rewrites the same slots)."""
        try:
            self.executor.sample(launched)
        except Exception:
            logger.exception(
                "sampling a step of %d requests failed; running it synchronously", len(launched.plan.chunks)
            )
            return False
        return True

    def _take_compiled(self) -> list[TokenEvent]:
        """Queue the requests whose grammar compiled; the final events of those refused or aborted."""
        events, self._pending_events = self._pending_events, []
        ready, failed = self.selector.take_compiled(
            idle=not self.scheduler.has_unfinished() and self._in_flight is None
        )
        for request in ready:
            self.scheduler.add(request)
        return events + failed

    def _execute(self, plan: StepPlan) -> list[TokenEvent]:
        started = time.perf_counter()
        result = self.executor.execute(plan)
        self.selector.accept(plan, result)
        events = self.scheduler.update(plan, result)
        self.stats.record(plan, result, events, time.perf_counter() - started)
        self._prune_cross_attention()
        return events

    def _complete(self, launched: LaunchedStep) -> list[TokenEvent]:
        try:
            result = launched.result()
        except Exception as exc:  # an asynchronous failure: its requests fail, the engine serves on
            logger.exception("a step of %d requests failed", len(launched.plan.chunks))
            result = StepResult.failed(launched.plan, f"{type(exc).__name__}: {exc}")
        self.selector.accept(launched.plan, result)
        events = self.scheduler.update(launched.plan, result)
        self.stats.record(launched.plan, result, events, time.perf_counter() - launched.started)
        self._prune_cross_attention()
        return events

    def _prune_cross_attention(self) -> None:
        """Free the image keys of the requests that just ended (the next step would, but there may be none)."""
        if self.cross_attention is not None:
            self.cross_attention.prune()

    def run_once(self) -> tuple[list[TokenEvent], EngineStats | None]:
        """One turn of a host loop (engine process or test thread): a step when there is work, then
        the stats report that is due, sent at once when the engine just went idle so that the
        queue/batch/KV gauges read zero without waiting for the next interval."""
        events, went_idle = [], False
        if self.has_unfinished():
            events = self.step()
            went_idle = not self.has_unfinished()
        return events, self.stats.report(force=went_idle)


def _load_tokenizer(config: EngineConfig):
    from tgi_compat.modeling.tokenizer import load_tokenizer

    return load_tokenizer(config.model_id, config.revision)


def selection_config(config: EngineConfig, info: EngineInfo) -> SelectionConfig:
    return SelectionConfig(
        vocab_size=info.vocab_size,
        device=torch.device(info.device),
        stop_token_ids=info.eos_token_ids,
        load_tokenizer=partial(_load_tokenizer, config),
        compile_limits=CompileLimits(config.grammar_compile_timeout, config.grammar_cache_bytes),
    )


def engine_info(config: EngineConfig, runner: Runner, model_config: ModelConfig) -> EngineInfo:
    max_positions = model_config.max_position_embeddings
    # A request's positions must fit the runner's req_to_token rows and leave admission room.
    max_total = min(config.max_total_tokens or max_positions, runner.max_seq_len, runner.num_kv_slots - 1)
    eos = tuple(dict.fromkeys([*model_config.eos_token_ids, *config.eos_token_ids]))
    return EngineInfo(
        model_id=config.model_id,
        architecture=model_config.multimodal_architecture or model_config.architecture,  # the checkpoint's
        dtype=str(runner.dtype).removeprefix("torch."),
        device=str(runner.device),
        vocab_size=model_config.vocab_size,
        max_position_embeddings=max_positions,
        num_kv_slots=runner.num_kv_slots,
        max_total_tokens=max_total,
        eos_token_ids=eos,
    )
