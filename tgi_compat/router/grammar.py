"""Grammar-constrained decoding on xgrammar (TGI's `grammar`, chat `response_format` and `tools`).

The API sends a GrammarSpec (kind + text) inside the engine request; everything tokenizer-bound
lives here, in the engine process:

    add_request --submit--> compile pool (xgrammar's cache; the step loop never waits on it)
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
Specs are compiled from xgrammar's EBNF with their bounded repetitions folded (tgi_compat/router/grammar_ebnf.py).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tgi_compat.router.grammar_ebnf import fold_bounded_repetitions
from tgi_compat.router.outputs import TokenEvent
from tgi_compat.router.request import FinishReason, GrammarKind, GrammarSpec, Request
from tgi_compat.router.step import StepPlan, StepResult

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

COMPILE_THREADS = 2  # compiles run beside the step loop; xgrammar releases the GIL while compiling
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
_CPP_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[12:00:00] /project/cpp/x.cc:83: " prefix


def fill_threads(num_rows: int) -> int:
    """How many threads fill the bitmask rows of `num_rows` constrained requests."""
    return 1 if num_rows <= SINGLE_THREAD_FILL_ROWS else MAX_FILL_THREADS


class GrammarCompileError(ValueError):
    """The spec does not compile; the message is what the client sees after TGI's prefix."""


def compile_error_message(spec: GrammarSpec, error: Exception) -> str:
    """TGI's texts: a schema that cannot be turned into a regex, or an invalid grammar."""
    detail = _CPP_LOCATION.sub("", str(error).strip()).strip()
    if spec.kind is GrammarKind.REGEX:
        return f"grammar is not valid: {detail}"
    return f"cannot compile regex from schema: {detail}"


class GrammarCompiler:
    """xgrammar's TokenizerInfo and compiler for one tokenizer, built on first use in a pool thread."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler = None

    def _xgrammar_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar

                started = time.perf_counter()
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._load_tokenizer(), vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=True)
                logger.info("grammar compiler ready in %.2f s", time.perf_counter() - started)
            return self._compiler

    def compile(self, spec: GrammarSpec) -> xgrammar.GrammarMatcher:
        """A fresh xgrammar.GrammarMatcher for the spec; GrammarCompileError when it does not compile."""
        import xgrammar

        compiler = self._xgrammar_compiler()
        try:
            if spec.kind is GrammarKind.ANY_JSON:
                compiled = compiler.compile_builtin_json_grammar()
            else:  # xgrammar's cache is keyed by the EBNF text, so a repeated spec compiles once
                compiled = compiler.compile_grammar(grammar_ebnf(spec))
        except (RuntimeError, ValueError, TypeError) as error:
            raise GrammarCompileError(compile_error_message(spec, error)) from error
        return xgrammar.GrammarMatcher(compiled)


def grammar_ebnf(spec: GrammarSpec) -> str:
    """The EBNF of a regex or JSON-schema spec, as xgrammar converts it, with its bounded repetitions
    folded (tgi_compat/router/grammar_ebnf.py: the same language, masks that fill fast)."""
    import xgrammar

    if spec.kind is GrammarKind.REGEX:
        grammar = xgrammar.Grammar.from_regex(spec.value)
    else:
        grammar = xgrammar.Grammar.from_json_schema(spec.value, any_whitespace=False, strict_mode=spec.strict)
    return fold_bounded_repetitions(str(grammar))


@dataclass(slots=True)
class GrammarMask:
    """One step's allowed-token bitmasks, compact: row r for the constrained sampled row row_index[r], or
    for sampled row r when row_index is None (every sampled row is constrained).

    On a GPU the tensors stay in pinned host memory, which CUDA maps into the device's address space
    (unified addressing): the two kernels read the ~1 MB of a 64-row step over PCIe in place. A copy to
    the device cost more host time (0.22 ms on an H200 host) than its 0.03 ms of device time."""

    bitmask: torch.Tensor  # [R, ceil(V/32)] int32
    row_index: torch.Tensor | None  # [R] int32, beside the bitmask
    device_readable: bool = False  # on a GPU, or pinned: the kernels read it where it is

    def apply(self, scores: torch.Tensor) -> torch.Tensor:
        """-inf on every token the grammar forbids (in place on a float32 [B, V]; one kernel on a GPU)."""
        scores = scores.contiguous()
        if self._readable_in_place(scores):
            from tgi_compat.kernels.sampling.grammar_apply import grammar_apply

            return grammar_apply(scores, self.bitmask, self.row_index)
        from tgi_compat.kernels.sampling.grammar_apply import grammar_apply_ref

        return grammar_apply_ref(scores, *self._on(scores.device))

    def confine(self, scores: torch.Tensor) -> torch.Tensor:
        """The last word on the constrained rows (in place), after every warper: whatever the request's
        parameters did to the scores, the token chosen from them is one the grammar allows.

        Extreme parameters break the masked scores: a temperature that is inf in float32 turns the
        masked -inf into NaN (-inf / inf), one that is 0 makes +inf (x / 0) whose log_softmax is NaN,
        and argmax takes NaN for the largest value, so the choice fell on the row's first NaN (token 0).
        Penalties can also push every allowed token to -inf. So NaN counts as -inf, +inf as the largest
        float, and a row left without a finite score takes its lowest allowed id (greedy or sampled).
        No processor after the mask turns -inf into a number, so forbidden tokens stay -inf. On the device
        with no host sync, one kernel on a GPU (tgi_compat/kernels/sampling/grammar_confine.py); the bitmask is not applied again."""
        if self._readable_in_place(scores) and scores.stride(1) == 1:
            from tgi_compat.kernels.sampling.grammar_confine import grammar_confine

            return grammar_confine(scores, self.bitmask, self.row_index)
        from tgi_compat.kernels.sampling.grammar_confine import grammar_confine_ref

        return grammar_confine_ref(scores, *self._on(scores.device))

    def _readable_in_place(self, scores: torch.Tensor) -> bool:
        """The Triton kernels take float32 scores on a GPU, and a mask the GPU can read."""
        return scores.is_cuda and scores.dtype == torch.float32 and self.device_readable

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The mask on `device`, for the torch reference (a copy only where it is elsewhere)."""
        row_index = None if self.row_index is None else self.row_index.to(device)
        return self.bitmask.to(device), row_index


class GrammarBackend:
    """Compiles specs off the step loop and constrains the requests that carry one."""

    def __init__(self, compiler: GrammarCompiler, device: torch.device) -> None:
        self.compiler = compiler
        self.device = torch.device(device)
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._compiling: dict[str, tuple[Request, Future]] = {}
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
        self._compiling[request.request_id] = (request, self._pool.submit(self.compiler.compile, spec))

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def abort(self, request_id: str) -> TokenEvent | None:
        """The abort event of a request still compiling (None: it is not here)."""
        entry = self._compiling.pop(request_id, None)
        if entry is None:
            return None
        entry[1].cancel()
        return TokenEvent(request_id, finish_reason=FinishReason.ABORT.value)

    def take_compiled(self) -> tuple[list[Request], list[TokenEvent]]:
        """Requests whose grammar is ready (matcher attached), and the final events of those whose
        grammar failed: `rejected`, with TGI's validation text."""
        ready, failed = [], []
        for request_id, (request, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                request.matcher = future.result()
            except GrammarCompileError as error:
                failed.append(_rejected(request_id, str(error)))
            except Exception as error:
                logger.exception("compiling the grammar of %s failed", request_id)
                spec = request.params.grammar
                assert spec is not None  # submit() took only constrained requests
                failed.append(_rejected(request_id, compile_error_message(spec, error)))
            else:
                ready.append(request)
        return ready, failed

    def wait(self, timeout: float = IDLE_WAIT_S) -> None:
        """Sleep until a compile finishes or `timeout` passes (the engine has nothing else to do)."""
        if self._compiling:
            wait([future for _, future in self._compiling.values()], timeout, return_when=FIRST_COMPLETED)

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
        pinned = self.device.type == "cuda"  # _host_buffer pins it there
        if total == size:
            return GrammarMask(bitmask, None, pinned)
        host[size:total] = torch.tensor([i for i, _ in constrained], dtype=torch.int32)
        return GrammarMask(bitmask, host[size:total], pinned)

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
            if not matcher.accept_token(token.token_id):  # GrammarMask.confine rules this out: a bug if seen
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

    def _batch(self, threads: int):
        if (batch_matcher := self._batch_matchers.get(threads)) is None:
            import xgrammar

            batch_matcher = self._batch_matchers[threads] = xgrammar.BatchGrammarMatcher(max_threads=threads)
        return batch_matcher

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _rejected(request_id: str, message: str) -> TokenEvent:
    return TokenEvent(request_id, finish_reason=FinishReason.REJECTED.value, error=message)
