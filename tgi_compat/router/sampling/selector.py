"""Token selection as one stage: the sampler, the grammar masks and token healing behind one object.

The executor builds a TokenSelector at construction and owns it; the engine reaches it for what happens
around a step (vLLM v1's sample + structured_output, SGLang's sampling + constrained):

    add(request)              at admission: its healer is loaded, its grammar submitted for compiling
    take_compiled(idle)       requests whose grammar compiled join the scheduler; failed ones finish
    sample(logits, requests)  a step's rows: batch parameters (carried across steps), masks, the sampler
    accept(plan, result)      the grammars' matchers take the step's tokens

The kernels (Triton on a GPU, torch references elsewhere) are chosen once, with the sampler. The grammar
backend and the healer are built on the first request that needs them: a server that never constrains
never imports xgrammar, and one that never heals never scans its vocabulary.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tgi_compat.router.outputs import TokenEvent
from tgi_compat.router.request import Request
from tgi_compat.router.sampling.batch import SamplingBatch, is_plain_greedy
from tgi_compat.router.sampling.batch_cache import SamplingBatchCache
from tgi_compat.router.sampling.grammar_compile import CompileLimits
from tgi_compat.router.sampling.output import SampledRows, SamplerOutput
from tgi_compat.router.sampling.sampler import Sampler, score_prompt
from tgi_compat.router.sampling.token_healing import TokenHealer, VocabularyTable
from tgi_compat.router.step import StepPlan, StepResult

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tgi_compat.modeling.parallel.vocab_logits import GreedyChoice
    from tgi_compat.router.sampling.grammar import GrammarBackend

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SelectionConfig:
    vocab_size: int
    device: torch.device
    stop_token_ids: tuple[int, ...]  # the engine's EOS set: all a completed grammar leaves open
    load_tokenizer: Callable[[], PreTrainedTokenizerBase]  # read by the grammars' and the healer's vocabulary scans
    compile_limits: CompileLimits


class TokenSelector:
    def __init__(self, config: SelectionConfig) -> None:
        self.config = config
        self.sampler = Sampler(config.vocab_size, config.device)
        self.batches = SamplingBatchCache(config.vocab_size, self.sampler.device)
        self.grammar: GrammarBackend | None = None  # built on the first grammar request
        self.healer: TokenHealer | None = None  # built on the first healing request
        self._plain_greedy_of: list[Request] = []  # the requests of the last greedy_only verdict
        self._plain_greedy = False

    @property
    def device(self) -> torch.device:
        return self.sampler.device

    # ---- around the steps -------------------------------------------------------------------------
    def add(self, request: Request) -> bool:
        """Prepare an admitted request's selection; False when it waits for its grammar to compile
        (take_compiled hands it back), True when it may be scheduled now."""
        params = request.params
        if params.healing_prefix:
            self.healing_table()
        if params.grammar is None:
            return True
        self._grammar_backend().submit(request)
        return False

    def healing_table(self) -> VocabularyTable:
        """Token healing's vocabulary; the healer is built on the first request that heals."""
        if self.healer is None:
            self.healer = TokenHealer(self._healing_vocabulary)
        return self.healer.table

    def abort(self, request_id: str) -> TokenEvent | None:
        """The abort event of a request still waiting for its grammar; None when it is not waiting here."""
        return self.grammar.abort(request_id) if self.grammar is not None else None

    @property
    def num_waiting(self) -> int:
        """Requests whose grammar is compiling or compiled but not taken yet."""
        return self.grammar.num_waiting if self.grammar is not None else 0

    def take_compiled(self, idle: bool) -> tuple[list[Request], list[TokenEvent]]:
        """Requests whose grammar is ready, and the final events of those refused. `idle`: the engine has
        nothing else to run, so this sleeps briefly on the compiles instead of spinning."""
        if self.grammar is None:
            return [], []
        if idle:
            self.grammar.wait()
        return self.grammar.take_compiled()

    def accept(self, plan: StepPlan, result: StepResult) -> None:
        """Every constrained request's matcher accepts the token it was just given (before the scheduler's update)."""
        if self.grammar is not None:
            self.grammar.advance(plan, result)

    def close(self) -> None:
        """Stop the grammar compiler's thread and child process."""
        if self.grammar is not None:
            self.grammar.shutdown()

    # ---- per step ---------------------------------------------------------------------------------
    def greedy_only(self, requests: list[Request]) -> bool:
        """Whether every request takes its logits row's argmax: a sharded runner then gathers no logits. The
        verdict is kept while the running set stays the same (parameters and grammars are fixed at admission)."""
        if requests != self._plain_greedy_of:  # identity per element (Request compares by identity)
            self._plain_greedy_of, self._plain_greedy = requests, all(map(is_plain_greedy, requests))
        return self._plain_greedy

    def sample(self, logits: torch.Tensor, requests: list[Request], offsets: list[int] | None = None) -> SampledRows:
        """Choose each row's token (logits [R, V], row r for requests[r]) and start the copy to the host.
        `offsets` (speculative verify rows): row r draws with the noise of its request's offsets[r]-th next token."""
        batch = self._batch(requests)
        if offsets is not None:
            steps = batch.steps + torch.tensor(offsets, dtype=torch.int64).to(self.device, non_blocking=True)
            batch = dataclasses.replace(batch, steps=steps)
        output = self.sampler(logits, batch)
        self.batches.sampled(output.token_ids)
        return output.start_copy()

    @staticmethod
    def from_greedy_choice(choice: GreedyChoice) -> SampledRows:
        """What `sample` returns for a plain-greedy step, from the choice a sharded runner made. The batch cache
        is left alone: it advances only over steps the sampler runs (a later one rebuilds it once)."""
        packed = choice.packed
        # no top-n: nothing reads all_logprobs
        return SamplerOutput(choice.token_ids, packed[1], None, all_logprobs=packed, packed=packed).start_copy()

    def score_prompt(self, logits: torch.Tensor, next_ids: list[int], top_n: list[int]) -> SampledRows:
        """Prompt logprobs (raw model distribution) of logits [P, V] predicting next_ids, with top_n[p] alternatives."""
        return score_prompt(
            logits.float(),
            torch.tensor(next_ids, dtype=torch.int64, device=self.device),
            torch.tensor(top_n, dtype=torch.int64, device=self.device),
            max(top_n, default=0),
        ).start_copy()

    def _batch(self, requests: list[Request]) -> SamplingBatch:
        batch = self.batches.get(requests, self.healer)
        if self.grammar is not None and (mask := self.grammar.mask(requests)) is not None:
            batch = dataclasses.replace(batch, grammar=mask)  # per step: the cached batch stays unmasked
        return batch

    def _grammar_backend(self) -> GrammarBackend:
        if self.grammar is None:
            from tgi_compat.router.sampling.grammar import GrammarBackend, GrammarCompiler

            config = self.config
            compiler = GrammarCompiler(
                config.load_tokenizer, config.vocab_size, config.stop_token_ids, config.compile_limits
            )
            self.grammar = GrammarBackend(compiler, self.device)
        return self.grammar

    def _healing_vocabulary(self) -> VocabularyTable:
        logger.info("loading the vocabulary for token healing")
        return VocabularyTable.from_tokenizer(self.config.load_tokenizer())
