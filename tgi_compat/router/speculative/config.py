"""Speculative decoding settings: TGI's `--speculate N` and vLLM's `--speculative-config` JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from tgi_compat.router.speculative.ngram import NgramConfig
from tgi_compat.router.speculative.policy import StepCostTable
from tgi_compat.router.speculative.suffix import SuffixConfig
from tgi_compat.router.speculative.synthetic import SyntheticAcceptance

Method = Literal["ngram", "suffix", "eagle3"]


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    num_speculative_tokens: int  # drafts verified per request per step, at most
    method: Method = "ngram"
    ngram: NgramConfig = field(default_factory=NgramConfig)
    suffix: SuffixConfig = field(default_factory=SuffixConfig)
    draft_model: str | None = None  # eagle3: the head's folder or hub id (speculators or EAGLE/SGLang format)
    # The device's step time against token rows: drafts only where they raise tokens per second.
    # None: every request verifies what its proposer drafts, up to num_speculative_tokens (TGI's fixed N).
    # (the engine measures it at startup on a GPU: tgi_compat/modeling/step_cost.py; or --speculative-config's)
    step_cost: StepCostTable | None = None
    # Steps of up to this many requests, all drafting, pad every request's drafts to one length, so that the
    # runner replays them as verify CUDA graphs (its largest verify bucket; set by the engine); 0: never
    uniform_max_batch: int = 0
    # Benchmarks on random weights only: accepted drafts drawn from this distribution, not matched (synthetic.py)
    synthetic_acceptance: SyntheticAcceptance | None = None

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if (self.method == "eagle3") != (self.draft_model is not None):
            raise ValueError('an EAGLE-3 head is given as {"method": "eagle3", "model": PATH}, and only for eagle3')

    @classmethod
    def from_tgi(cls, speculate: int) -> SpeculativeConfig | None:
        """`--speculate N`: n-gram drafts of up to N tokens (no checkpoint here has Medusa heads); 0: off."""
        return cls(num_speculative_tokens=speculate) if speculate > 0 else None

    @classmethod
    def from_vllm_json(cls, text: str) -> SpeculativeConfig:
        """vLLM's `--speculative-config` for its model-free methods and EAGLE-3 heads, e.g.
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
        {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 24}
        {"method": "eagle3", "model": "path/to/head", "num_speculative_tokens": 3}
        and ours: "step_cost": {"rows": [1, 64, 512], "seconds": [...]} (instead of measuring it at startup),
        "synthetic_acceptance": [weights of accepted lengths 0..k] or "hist.json" (benchmark-only)."""
        spec = json.loads(text)
        if not isinstance(spec, dict):
            raise ValueError("--speculative-config must be a JSON object")
        method = spec.pop("method", "ngram")
        if method not in ("ngram", "suffix", "eagle3"):
            raise ValueError(f"speculative method {method!r} is not supported (ngram, suffix, eagle3)")
        draft_model = spec.pop("model", None)
        k = int(spec.pop("num_speculative_tokens", 0))
        ngram = NgramConfig(int(spec.pop("prompt_lookup_min", 1)), int(spec.pop("prompt_lookup_max", 4)))
        suffix = SuffixConfig(
            max_depth=int(spec.pop("suffix_decoding_max_tree_depth", 24)),
            min_token_probability=float(spec.pop("suffix_decoding_min_token_prob", 0.1)),
            corpus_outputs=int(spec.pop("suffix_decoding_max_cached_requests", 0)),
        )
        step_cost = None
        if (table := spec.pop("step_cost", None)) is not None:
            step_cost = StepCostTable(tuple(int(r) for r in table["rows"]), tuple(float(s) for s in table["seconds"]))
        synthetic = None
        if (acceptance := spec.pop("synthetic_acceptance", None)) is not None:
            synthetic = SyntheticAcceptance.parse(acceptance)
        if spec:
            raise ValueError(f"unsupported --speculative-config keys: {', '.join(sorted(spec))}")
        return cls(
            num_speculative_tokens=k,
            method=method,
            draft_model=draft_model,
            ngram=ngram,
            suffix=suffix,
            step_cost=step_cost,
            synthetic_acceptance=synthetic,
        )
