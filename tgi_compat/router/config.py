"""Engine configuration: filled by the TGI launcher or LightLLM's api_server, read by the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from tgi_compat.router.speculative.config import SpeculativeConfig

# a vision model's encoder rows kept at most: ~75,000 rows of Qwen2.5-VL-7B (hidden 3584, bf16), 55 images of 1024px
IMAGE_CACHE_BYTES = 512 << 20


@dataclass(frozen=True, slots=True)
class LoraSource:
    """A LoRA adapter to load: its name in requests, and a local folder or hub id (at a revision)."""

    name: str
    source: str
    revision: str | None = None


@dataclass(slots=True)
class EngineConfig:
    model_id: str  # local folder, .gguf file, or hub id
    revision: str | None = None
    dtype: str | None = None  # float32/float16/bfloat16; None: float32 on CPU, bfloat16 on GPU
    device: str | None = None  # None: cuda if available else cpu
    attention_backend: str | None = None  # "torch" | "triton"; None: triton on GPU, torch on CPU
    # Weight quantization scheme (tgi_compat.modeling.layers.quantization.select); a quantized checkpoint decides anyway
    quantize: str | None = None
    kv_cache_dtype: str | None = None  # None: the model's dtype; fp8_e4m3fn / fp8_e5m2 (and vLLM's spellings)
    load_format: str = "auto"  # vLLM --load-format: "auto" (the checkpoint) or "dummy" (random weights)
    # KV capacity in tokens (TGI --max-batch-total-tokens / LightLLM --max_total_token_num).
    # None: from free device memory x cuda_memory_fraction on GPU, a fixed default on CPU.
    max_batch_total_tokens: int | None = None
    cuda_memory_fraction: float = 1.0
    max_batch_prefill_tokens: int = 4096  # new prompt tokens per step (chunk size for long prompts)
    max_mixed_prefill_tokens: int | None = None  # ... in a step that also decodes; None: max_batch_prefill_tokens
    max_running_requests: int = 256  # TGI --max-batch-size / LightLLM --running_max_req_size
    max_total_tokens: int | None = None  # per-request prompt + generated cap; None: from the model
    router_token_ratio: float = 0.0  # LightLLM: below this KV use, admit optimistically
    router_max_new_token_len: int = 1024  # LightLLM: optimistic estimate of a request's output
    max_waiting_tokens: int = 20  # TGI: decode steps a few waiting requests may be held back
    waiting_served_ratio: float = 0.3  # TGI: waiting/running ratio that admits at once
    cuda_graphs: list[int] | None = None  # decode batch sizes to capture; [] disables
    eos_token_ids: list[int] = field(default_factory=list)  # extra EOS ids (LightLLM --eos_id)
    seed: int = 0
    # Schedule and launch step N+1 before waiting for step N (tgi_compat/router/engine.py), so that the host's
    # work per step runs while the GPU computes. None: on for CUDA, off elsewhere (a CPU forward is
    # synchronous, so there is nothing to hide the host work behind); tests force it on.
    overlap_scheduling: bool | None = None
    # Tensor parallelism (TGI --num-shard): one process per rank; rank 0 schedules, the others follow.
    num_shard: int = 1
    master_addr: str = "localhost"  # torch.distributed rendezvous of the ranks (TGI --master-addr/-port)
    master_port: int = 29500
    # Reuse the KV of cached prompt prefixes (tgi_compat/router/prefix_cache.py): TGI PREFIX_CACHING, vLLM
    # --enable-prefix-caching, LightLLM --use_dynamic_prompt_cache.
    prefix_caching: bool = True
    # LightLLM --diverse_mode: rows on one cached prefix (n / best_of siblings) decode through the shared-prefix
    # attention kernel, which reads that prefix once per group (tgi_compat/kernels/attention/shared_prefix.py)
    diverse_mode: bool = False
    # LoRA (vLLM --enable-lora; TGI --lora-adapters): max_loras device slots (adapters in one step; 0: LoRA off),
    # max_cpu_loras adapters loaded at once, ranks up to max_lora_rank; lora_adapters loaded at startup.
    max_loras: int = 0
    max_cpu_loras: int = 0
    max_lora_rank: int = 16
    lora_adapters: list[LoraSource] = field(default_factory=list)
    # A vision model's encoder-output cache (tgi_compat/router/image_cache.py), LightLLM --cache_capacity and
    # --cache_reserved_ratio: images whose rows are kept, and the share of them kept when it overflows; and the
    # bytes of rows it keeps at most (on the device: left out of the KV cache's budget).
    image_cache_capacity: int = 200
    image_cache_reserved_ratio: float = 0.5
    image_cache_bytes: int = IMAGE_CACHE_BYTES
    # Grammar compiles (tgi_compat/router/sampling/grammar_compile.py): the bytes of compiled grammars kept for reuse
    # (one may take an eighth of them), and the seconds one compile may take.
    grammar_cache_bytes: int = 512 * 2**20
    grammar_compile_timeout: float = 30.0
    # Speculative decoding with model-free drafts or an EAGLE-3 head (TGI --speculate N, vLLM --speculative-config); None: off
    speculative: SpeculativeConfig | None = None
