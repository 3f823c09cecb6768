"""Grammar-constrained decoding on xgrammar (TGI's `grammar`, chat `response_format` and `tools`).

The API sends a GrammarSpec (kind + text) inside the engine request; everything tokenizer-bound
lives here, in the engine process:

    add_request --submit--> compiled grammars (LRU, --grammar-cache-bytes) or the compile thread, which
                            compiles in a child process (tgi_compat/router/sampling/grammar_compile.py: one at a time,
                            stopped at --grammar-compile-timeout or when no request waits for it any more);
                            requests with the same spec share one compile; the step loop never waits on it
    step: take_compiled() -> ready requests join the scheduler's queue, failures finish at once
          advance(plan, result) -> each matcher accepts its request's sampled token
          mask(rows) -> [R, ceil(V/32)] int32 for the R constrained rows (+ their row index), filled by
                        xgrammar (GIL released) after the executor has queued the forward, so on a GPU the
                        fill runs while the forward does; no copy: the GPU kernels read the pinned host
                        buffer in place
          Sampler applies it after the penalties, before temperature/top-k/top-p (TGI's order), and
          confines the constrained rows after the warpers (tgi_compat/kernels/sampling/grammar_apply.py, grammar_confine.py)

With overlap scheduling, step N's forward is queued before step N-1's tokens reach the host; the
engine then advances the matchers by N-1's tokens and fills N's masks while forward N runs, and the
executor queues N's sampling after them (tgi_compat/router/engine.py, StepExecutor.sample).
A completed grammar leaves only the EOS ids open (xgrammar's stop tokens are the engine's EOS set),
so a finished answer ends with TGI's `eos_token` and a capped one is a prefix with `length`.
Batches without a constrained request never reach this module. The backend itself is built on the
first grammar request: servers that never constrain pay nothing, not even the vocabulary scan.
Specs are compiled from xgrammar's EBNF with their bounded repetitions folded (tgi_compat/router/sampling/grammar_ebnf.py).
The engine holds at most --grammar-cache-bytes of compiled grammars besides those its running requests use.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tgi_compat.router.outputs import TokenEvent
from tgi_compat.router.request import FinishReason, GrammarSpec, Request
from tgi_compat.router.sampling.grammar_compile import (
    CompileLimits,
    CompileProcess,
    GrammarCompileError,
    compile_error_message,
    return_freed_memory,
)
from tgi_compat.router.step import StepPlan, StepResult

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# JSON comes out with single spaces after `,` and `:` (outlines, which TGI uses, allows one optional
# space there and no newlines), so a small model cannot pad an answer with blanks forever; strict
# mode closes objects to their listed properties, as outlines' regexes do.
# Threads of the batched bitmask fill (fill_threads is the one place that picks them). Most fills cost a
# few us a row, less than waking xgrammar's threads: on the H100 host (16 cores) 64 rows of the benchmark
# schema filled in 0.61 ms median on one thread and 2.12 / 3.50 / 1.09 ms on 2 / 4 / 8, and on the 2-core
# development machine in 0.36 ms on one thread and 9.0 ms on two. So one thread fills up to
# SINGLE_THREAD_FILL_ROWS rows, and larger batches up to 4 of the cores this process may run on (counted
# from its affinity: xgrammar's "auto" reads the host's CPU count, and a container may see a fraction of it).
# benchmarks/device/grammar.py sweeps threads x rows and prints the crossover to set this from.
# At 64 rows the hosts disagreed (H100 host, 2026-11-24: 4 threads ahead in one sweep), and the engine's
# own path on an H200 host (2026-11-27, interleaved runs) filled 64 rows in 0.59 / 0.53 ms on one thread
# against 0.61 / 0.62 ms on four, and the whole mask cost 0.96 / 0.86 against 0.99 / 1.04 ms.
SINGLE_THREAD_FILL_ROWS = 64
MAX_FILL_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) // 2))  # 8 threads lost to 4 at every size
IDLE_WAIT_S = 0.005  # how long an otherwise idle engine sleeps on pending compiles per turn
# A grammar read back from more JSON than this returns the parse's freed memory to the system (a 27 MiB
# JSON took +350 MiB while read, +42 MiB after return_freed_memory; small ones free next to nothing).
RETURN_FREED_MEMORY_BYTES = 1 << 20


def fill_threads(num_rows: int) -> int:
    """How many threads fill the bitmask rows of `num_rows` constrained requests."""
    return 1 if num_rows <= SINGLE_THREAD_FILL_ROWS else MAX_FILL_THREADS


class GrammarCompiler:
    """Specs compiled for one tokenizer in the compile process, read back here. The tokenizer is scanned on
    the first compile (about a second). compile() runs in one thread at a time; cancel() from any."""

    def __init__(
        self,
        load_tokenizer: Callable[[], PreTrainedTokenizerBase],
        vocab_size: int,
        stop_token_ids: Sequence[int],
        limits: CompileLimits,
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.limits = limits
        self._info: xgrammar.TokenizerInfo | None = None
        self._process: CompileProcess | None = None

    def compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        """The compiled grammar, once compiled (this blocks); GrammarCompileError, or CompileCancelled."""
        import xgrammar

        if self._info is None or self._process is None:
            started = time.perf_counter()
            self._info = xgrammar.TokenizerInfo.from_huggingface(
                self._load_tokenizer(), vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._process = CompileProcess(self._info.serialize_json(), self.limits)
            logger.info("grammar tokenizer info ready in %.2f s", time.perf_counter() - started)
        serialized = self._process.compile(spec)
        compiled = xgrammar.CompiledGrammar.deserialize_json(serialized, self._info)
        if len(serialized) > RETURN_FREED_MEMORY_BYTES:
            del serialized
            return_freed_memory()
        return compiled

    def cancel(self, spec: GrammarSpec) -> None:
        """Stop the compile of `spec` if it is running."""
        if self._process is not None:
            self._process.cancel(spec)

    def shutdown(self) -> None:
        if self._process is not None:
            self._process.shutdown()


class CompiledGrammars:
    """The compiled grammars kept for reuse, least recently used dropped first past `max_bytes` (the sizes
    xgrammar reports). A dropped grammar lives on in the matchers of the requests that use it."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._grammars: OrderedDict[GrammarSpec, xgrammar.CompiledGrammar] = OrderedDict()

    def get(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar | None:
        compiled = self._grammars.get(spec)
        if compiled is not None:
            self._grammars.move_to_end(spec)
        return compiled

    def put(self, spec: GrammarSpec, compiled: xgrammar.CompiledGrammar) -> None:
        self._grammars[spec] = compiled
        self.num_bytes += compiled.memory_size_bytes
        while self.num_bytes > self.max_bytes:
            _, dropped = self._grammars.popitem(last=False)
            self.num_bytes -= dropped.memory_size_bytes


@dataclass(slots=True)
class _Compile:
    """One spec's compile and the requests waiting for it."""

    future: Future[xgrammar.CompiledGrammar]
    requests: list[Request]


@dataclass(slots=True)
class GrammarMask:
    """One step's allowed-token bitmasks, compact: row r for the constrained sampled row row_index[r], or
    for sampled row r when row_index is None (every sampled row is constrained). The sampler applies them
    after the penalties and confines the rows after the warpers (SamplingKernels.apply_grammar, .confine_grammar).

    On a GPU the tensors stay in pinned host memory, which CUDA maps into the device's address space
    (unified addressing): the two kernels read the ~1 MB of a 64-row step over PCIe in place. A copy to
    the device cost more host time (0.22 ms on an H200 host) than its 0.03 ms of device time."""

    bitmask: torch.Tensor  # [R, ceil(V/32)] int32
    row_index: torch.Tensor | None  # [R] int32, beside the bitmask


class GrammarBackend:
    """Compiles specs off the step loop and constrains the requests that carry one."""

    def __init__(self, compiler: GrammarCompiler, device: torch.device) -> None:
        self.compiler = compiler
        self.device = torch.device(device)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")  # the child compiles one at a time
        self.compiled = CompiledGrammars(compiler.limits.cache_bytes)
        self._compiles: dict[GrammarSpec, _Compile] = {}
        self._waiting: dict[str, GrammarSpec] = {}  # request id -> the spec it waits for
        self._ready: list[Request] = []  # found compiled at submit(), not yet taken
        # Reused, pinned on a GPU (pinning is a slow cudaHostAlloc): a step's masks are filled after the
        # previous step's result, which waited for the device to finish that step's sampling, and with it
        # the kernels that read its masks. Flat int32: the compact bitmask rows, then the row index.
        self._host: torch.Tensor | None = None
        self._num_words = (compiler.vocab_size + 31) // 32  # xgrammar's bitmask width
        self._stop_token_ids = frozenset(compiler.stop_token_ids)
        self._batch_matchers: dict[int, xgrammar.BatchGrammarMatcher] = {}  # by thread count
        self._stop_row: torch.Tensor | None = None

    # ---- compile --------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        spec = request.params.grammar
        assert spec is not None, "only constrained requests compile a grammar"
        if (compiled := self.compiled.get(spec)) is not None:
            request.matcher = _matcher(compiled)
            self._ready.append(request)
        elif (compile_ := self._compiles.get(spec)) is not None:
            compile_.requests.append(request)
            self._waiting[request.request_id] = spec
        else:
            self._compiles[spec] = _Compile(self._pool.submit(self.compiler.compile, spec), [request])
            self._waiting[request.request_id] = spec

    @property
    def num_waiting(self) -> int:
        """Requests whose grammar is not taken yet (compiling, or ready for take_compiled)."""
        return len(self._waiting) + len(self._ready)

    def abort(self, request_id: str) -> TokenEvent | None:
        """The abort event of a request waiting for its grammar (None: it is not here). A compile nobody
        waits for any more is dropped: it never starts, or its child is killed."""
        if (spec := self._waiting.pop(request_id, None)) is not None:
            compile_ = self._compiles[spec]
            compile_.requests = [r for r in compile_.requests if r.request_id != request_id]
            if not compile_.requests:
                del self._compiles[spec]
                if not compile_.future.cancel():
                    self.compiler.cancel(spec)
        elif request_id in (ids := [r.request_id for r in self._ready]):
            del self._ready[ids.index(request_id)]
        else:
            return None
        return TokenEvent(request_id, finish_reason=FinishReason.ABORT.value)

    def take_compiled(self) -> tuple[list[Request], list[TokenEvent]]:
        """Requests whose grammar is ready (matcher attached), and the final events of those whose
        grammar failed: `rejected`, with TGI's validation text."""
        ready, self._ready = self._ready, []
        failed: list[TokenEvent] = []
        for spec, compile_ in list(self._compiles.items()):
            if not compile_.future.done():
                continue
            del self._compiles[spec]
            for request in compile_.requests:
                del self._waiting[request.request_id]
            try:
                compiled = compile_.future.result()
            except GrammarCompileError as error:
                failed += [_rejected(r.request_id, str(error)) for r in compile_.requests]
                continue
            except Exception as error:
                logger.exception("compiling a grammar failed")
                failed += [_rejected(r.request_id, compile_error_message(spec, str(error))) for r in compile_.requests]
                continue
            self.compiled.put(spec, compiled)
            for request in compile_.requests:
                request.matcher = _matcher(compiled)
                ready.append(request)
        return ready, failed

    def wait(self, timeout: float = IDLE_WAIT_S) -> None:
        """Sleep until a compile finishes or `timeout` passes (the engine has nothing else to do)."""
        if self._compiles and not self._ready:
            futures = [compile_.future for compile_ in self._compiles.values()]
            wait(futures, timeout, return_when=FIRST_COMPLETED)

    # ---- per step -------------------------------------------------------------------------
    def mask(self, requests: Sequence[Request]) -> GrammarMask | None:
        """The bitmask of this step's sampled rows, in the reused host buffer (pinned on a GPU, whose kernels
        read it there; valid until the next call); None when none of them is constrained. Called once the
        step's forward is queued: the mask reads only tokens already accepted, not the logits."""
        constrained = [(i, request) for i, request in enumerate(requests) if request.matcher is not None]
        if not constrained:
            return None
        num_rows, num_words = len(constrained), self._num_words
        size = num_rows * num_words
        total = size + num_rows if num_rows < len(requests) else size  # a row index when some rows are not
        host = self._host_buffer(total)
        bitmask = host[:size].view(num_rows, num_words)
        matchers: list[xgrammar.GrammarMatcher] = []
        fill_rows: list[int] = []
        for k, (_, request) in enumerate(constrained):
            if request.grammar_terminated:
                # The grammar is complete and the request goes on (ignore_eos): only a stop token is
                # allowed, as xgrammar would have it (its matcher refuses to fill a mask once terminated).
                bitmask[k] = self._stop_tokens_row()
            else:
                assert request.matcher is not None
                matchers.append(request.matcher)
                fill_rows.append(k)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, fill_rows[0])
        elif matchers:  # rows 0..n-1 in order, the usual case, need no index list
            indices = None if len(matchers) == num_rows else fill_rows
            self._batch(fill_threads(len(matchers))).batch_fill_next_token_bitmask(matchers, bitmask, indices)
        if total == size:
            return GrammarMask(bitmask, None)
        host[size:total] = torch.tensor([i for i, _ in constrained], dtype=torch.int32)
        return GrammarMask(bitmask, host[size:total])

    def _stop_tokens_row(self) -> torch.Tensor:
        """One bitmask row (int32 words, bit t % 32 of word t // 32) allowing only the stop tokens."""
        if self._stop_row is None:
            words = torch.zeros(self._num_words, dtype=torch.int64)
            for token_id in self.compiler.stop_token_ids:
                words[token_id // 32] |= 1 << (token_id % 32)
            if not self.compiler.stop_token_ids:
                words.fill_(-1)  # no stop token known: leave the row unconstrained rather than empty
            self._stop_row = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        return self._stop_row

    def advance(self, plan: StepPlan, result: StepResult) -> None:
        """Every constrained request accepts the token it was just given (before update() sees it)."""
        for chunk, token in zip(plan.chunks, result.tokens):
            request, matcher = chunk.request, chunk.request.matcher
            if matcher is None or token is None or request.is_finished or request.grammar_terminated:
                continue
            if not matcher.accept_token(token.token_id):  # the sampler's confinement rules this out: a bug if seen
                logger.warning("request %s: token %d is outside its grammar", request.request_id, token.token_id)
            elif token.token_id in self._stop_token_ids:
                # Only a stop token completes the grammar (xgrammar's matchers wait for one), so the
                # per-step fill asks no matcher whether it terminated.
                request.grammar_terminated = matcher.is_terminated()

    def _host_buffer(self, num_words: int) -> torch.Tensor:
        if self._host is None or self._host.numel() < num_words:
            buffer = torch.empty(max(num_words, 64 * (self._num_words + 1)), dtype=torch.int32)
            self._host = buffer.pin_memory() if self.device.type == "cuda" else buffer
        return self._host

    def _batch(self, threads: int) -> xgrammar.BatchGrammarMatcher:
        if (batch_matcher := self._batch_matchers.get(threads)) is None:
            import xgrammar

            batch_matcher = self._batch_matchers[threads] = xgrammar.BatchGrammarMatcher(max_threads=threads)
        return batch_matcher

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.compiler.shutdown()


def _matcher(compiled: xgrammar.CompiledGrammar) -> xgrammar.GrammarMatcher:
    import xgrammar

    return xgrammar.GrammarMatcher(compiled)


def _rejected(request_id: str, message: str) -> TokenEvent:
    return TokenEvent(request_id, finish_reason=FinishReason.REJECTED.value, error=message)
