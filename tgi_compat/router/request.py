"""What crosses from the API layer into the engine: one generation request, in token ids.

tgi_compat validates and tokenizes; the router only ever sees ids. Stop *strings* stay in
tgi_compat; stop *token ids* come here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tgi_compat.router.images import PromptImage, image_keyed_ids, whole_images
from tgi_compat.router.mrope import MropePrompt, prompt_mrope

if TYPE_CHECKING:
    import xgrammar

    from tgi_compat.router.prefix_cache import PrefixMatch
    from tgi_compat.router.stopping import HealingCount


class RequestStatus(enum.Enum):
    WAITING = enum.auto()  # queued, holds no KV slots
    RUNNING = enum.auto()  # holds a request row and KV slots
    PREEMPTED = enum.auto()  # slots freed under memory pressure; re-prefilled when re-admitted
    FINISHED = enum.auto()


class FinishReason(enum.StrEnum):
    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_TOKEN = "stop_sequence"  # a stop token id (TGI reports stop strings the same way)
    ABORT = "abort"  # the client went away
    ERROR = "error"  # the step that served this request raised
    REJECTED = "rejected"  # refused after it was queued (its grammar does not compile): a validation error


class GrammarKind(enum.StrEnum):
    JSON_SCHEMA = "json_schema"  # value: the schema as JSON text
    ANY_JSON = "any_json"  # any JSON value (response_format `json_object` without a schema)
    REGEX = "regex"  # value: the regular expression


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What the generated text must match; the engine compiles it (tgi_compat/router/sampling/grammar.py)."""

    kind: GrammarKind
    value: str = ""
    # JSON schemas: objects closed to their listed properties where the schema says nothing (xgrammar's
    # strict mode, TGI's grammars); False keeps JSON Schema's default (OpenAI's `"strict": false`).
    strict: bool = True


# A request that ran to its end reports one of these, TGI's finish reasons (tgi_compat.api.protocol.tgi);
# ABORT and ERROR never reach a client as a finish reason.
COMPLETED_FINISH_REASONS = frozenset({FinishReason.LENGTH, FinishReason.EOS_TOKEN, FinishReason.STOP_TOKEN})


@dataclass(slots=True)
class SamplingParams:
    """Per-request token selection, in TGI's processing order (docs/contract.md §14)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1.0 disables
    typical_p: float = 1.0  # 1.0 disables
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    watermark: bool = False
    seed: int | None = None  # None: the engine picks one when the request samples
    top_n_tokens: int = 0  # alternatives reported per generated token, and per prompt position with prompt_logprobs
    # OpenAI/vLLM `logit_bias`: (token id, bias) pairs added to the raw logits before every processor
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def is_sampling(self) -> bool:
        # TGI samples when any warper is active, even with do_sample=false.
        return self.do_sample or self.temperature != 1.0 or self.top_k != 0 or self.top_p < 1.0 or self.typical_p < 1.0


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 20
    stop_token_ids: list[int] = field(default_factory=list)  # besides the model's EOS set
    ignore_eos: bool = False
    prompt_logprobs: bool = False  # report a logprob for every prompt token (first is None)
    # Token healing: the healed prompt's removed text; generation is constrained until it is covered.
    healing_prefix: str | None = None
    grammar: GrammarSpec | None = None  # constrain the generated text (TGI's `grammar`)
    adapter_id: str | None = None  # a loaded LoRA adapter's name; None: the base model
    images: list[PromptImage] = field(default_factory=list)  # a vision model's prompt images, in prompt order


@dataclass(slots=True, eq=False)
class Request:
    """Engine-side state of one request (never leaves the engine process).

    vLLM v1 style: there is no prefill or decode phase. `num_computed_tokens` (tokens whose K/V
    sit in the cache, or are being written by a scheduled step) catches up with `num_tokens` (prompt
    + generated); a step that reaches the end samples the next token. Preemption sets it back to 0
    and the request re-prefills prompt + generated later.

    With overlap scheduling the newest generated token may still be on the device when the next
    step is scheduled: `num_pending_tokens` counts it (in `num_tokens`, although `output_ids` does
    not hold it yet); which output row holds it is the executor's business (tgi_compat/router/executor.py).
    """

    params: GenerateRequest
    arrival: int  # admission order; the newest running request is preempted first
    seed: int | None = None  # resolved seed, for sampling requests only
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    row: int | None = None  # row in the runner's req_to_token table while RUNNING
    slots: list[int] = field(default_factory=list)  # KV slot of token j at slots[j]
    num_preemptions: int = 0
    # Filled chunk by chunk when params.prompt_logprobs; sent once with the first token.
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_tokens: list[list] = field(default_factory=list)  # list[list[TopToken]]
    finish_reason: FinishReason | None = None
    num_pending_tokens: int = 0  # sampled, still on the device (see the class docstring)
    matcher: xgrammar.GrammarMatcher | None = None  # a constrained request's, once compiled
    grammar_terminated: bool = False  # its matcher accepted a stop token: the grammar is complete
    # Prefix caching: the cached prefix this request runs on (locked in the tree: slots[:its length]
    # are the tree's, the rest its own), and how many leading tokens have K/V written by completed
    # steps (with overlap scheduling, num_computed_tokens also counts the step still in flight).
    cached_prefix: PrefixMatch | None = None
    num_kv_written: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens its first admission found cached (usage reports)
    lora_id: int = 0  # its LoRA adapter's engine-wide id (never reused), 0: the base model
    lora_slot: int = -1  # the device slot of its adapter while it runs (tgi_compat.router.lora_slots), -1: none
    healing: HealingCount | None = None  # a healing request's tokens that re-cover its prompt (not counted)
    # an M-RoPE model's request with an image: its (t, h, w) prompt positions and rope delta (router/mrope.py)
    mrope: MropePrompt | None = None

    def __post_init__(self) -> None:
        if self.params.images:
            self.mrope = prompt_mrope(len(self.params.prompt_ids), self.params.images)

    @property
    def request_id(self) -> str:
        return self.params.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.params.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.params.prompt_ids) + self.num_output_tokens

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, the one still on the device included."""
        return len(self.output_ids) + self.num_pending_tokens

    @property
    def reads_own_tokens_to_sample(self) -> bool:
        """Penalties, the watermark and token healing read the generated ids on the host, so the next
        token of such a request cannot be drawn while its previous one is still on the device. (A grammar
        reads them too, but only at sampling time, which the engine defers past the forward instead.)"""
        sampling, params = self.params.sampling, self.params
        return (
            sampling.repetition_penalty != 1.0
            or sampling.frequency_penalty != 0.0
            or sampling.watermark
            or params.healing_prefix is not None
        )

    @property
    def num_new_tokens(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    def prefill_chunk_size(self, budget: int) -> int:
        """New tokens of its next prefill chunk, at most `budget`, but never ending inside an image whose
        placeholders attend to each other both ways (tgi_compat.router.images.whole_images)."""
        num_new = min(self.num_new_tokens, budget)
        if num_new <= 0 or not self.params.images:
            return num_new
        return whole_images(self.num_computed_tokens, num_new, self.params.images)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Ids of positions [start, end) of prompt + generated."""
        prompt = self.params.prompt_ids
        if end <= len(prompt):
            return prompt[start:end]
        out_start = max(0, start - len(prompt))
        return prompt[start:] + self.output_ids[out_start : end - len(prompt)]

    def cache_ids(self, end: int) -> list[int]:
        """Ids of positions [0, end) as the prefix cache keys them: image placeholders by their image
        (tgi_compat.router.images); under an adapter, tagged with its id above the vocabulary (bit 32 up), so
        that one prompt under two adapters (or the base) never shares K/V."""
        ids = self.token_ids(0, end)
        if self.params.images:
            ids = image_keyed_ids(ids, self.params.images)
        if not self.lora_id:
            return ids
        tag = self.lora_id << 32
        return [tag + token for token in ids]

    def record_prompt_scores(self, start: int, logprobs: list[float], top_tokens: list[list]) -> None:
        """One prefill chunk's scores of prompt tokens start+1.. (the first prompt token has none)."""
        if start == 0:
            self.prompt_logprobs.append(None)
            self.prompt_top_tokens.append([])
        self.prompt_logprobs.extend(logprobs)
        if self.params.sampling.top_n_tokens > 0:
            self.prompt_top_tokens.extend(top_tokens)

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
