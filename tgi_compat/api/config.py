"""ServerConfig: every option of `text-generation-launcher`, as one plain dataclass.

The TGI launcher (launcher.py) and LightLLM's api_server both fill this object; the engine part
of it is handed to the router as an `EngineConfig` by `to_engine_config()`.
Defaults follow TGI 3.3 (docs/contract.md §12). `None` means "derive it at startup" (see `ServingLimits`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tgi_compat.api.lora_flags import parse_lora_module, parse_tgi_lora_adapters
from tgi_compat.router.config import EngineConfig, LoraSource
from tgi_compat.router.speculative.config import SpeculativeConfig


def default_model_id() -> str:
    """The embedded SmolLM2 (TGI's own default, bloom-560m, needs the Hub we do not have)."""
    from tgi_compat.modeling.source import DEFAULT_MODEL_ID

    return DEFAULT_MODEL_ID


@dataclass(slots=True)
class ServerConfig:
    # --- model ---
    model_id: str = field(default_factory=default_model_id)
    revision: str | None = None
    dtype: str | None = None
    quantize: str | None = None
    kv_cache_dtype: str | None = None
    load_format: str = "auto"  # vLLM --load-format: auto (the checkpoint) | dummy (random weights, no files)
    trust_remote_code: bool = False
    speculate: int | None = None  # TGI: n-gram drafts per step
    speculative_config: str | None = None  # vLLM's JSON (ngram / suffix / eagle3); not with --speculate
    rope_scaling: str | None = None
    rope_factor: float | None = None
    tokenizer_config_path: str | None = None
    lora_adapters: str | None = None  # TGI: id[@revision] or name=path, comma separated
    enable_lora: bool = False  # vLLM: serve LoRA adapters (implied by any adapter flag)
    lora_modules: list[str] = field(default_factory=list)  # vLLM / AIAK: name=path or JSON, one per entry
    max_loras: int | None = None  # adapters in one step (device slots); None: as many as startup adapters, >= 1
    max_cpu_loras: int | None = None  # adapters loaded at once; None: max(max_loras, startup adapters, 8)
    max_lora_rank: int | None = None  # None: vLLM's 16, or 64 with TGI's --lora-adapters (TGI has no cap)
    huggingface_hub_cache: str | None = None
    weights_cache_override: str | None = None
    disable_custom_kernels: bool = False
    # --- sharding / devices ---
    num_shard: int = 1  # resolved by the launcher from --num-shard/--sharded/-tp and the visible GPUs
    master_addr: str = "localhost"
    master_port: int = 29500
    shard_uds_path: str = "/tmp/text-generation-server"
    cuda_memory_fraction: float = 1.0
    cuda_graphs: list[int] | None = None  # None: engine default; [] disables
    device: str | None = None  # ours: "cpu" / "cuda"; None = auto
    attention_backend: str | None = None  # ours: "torch" / "triton"; None = auto
    # --- request limits ---
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_input_tokens: int | None = None  # None: max_total_tokens - 1
    max_total_tokens: int | None = None  # None: from the engine (KV capacity, model max length)
    max_client_batch_size: int = 4
    payload_limit: int = 2_000_000
    validation_workers: int = 2
    # --- batching ---
    waiting_served_ratio: float = 0.3
    max_batch_prefill_tokens: int | None = None
    max_mixed_prefill_tokens: int | None = None  # ours: prompt tokens in steps that also decode
    max_batch_total_tokens: int | None = None
    max_waiting_tokens: int = 20
    max_batch_size: int | None = None
    # --- features ---
    enable_prefill_logprobs: bool = False
    prefix_caching: bool = True  # TGI PREFIX_CACHING, vLLM --[no-]enable-prefix-caching
    enable_prompt_tokens_details: bool = False  # vLLM: OpenAI usage.prompt_tokens_details.cached_tokens
    disable_grammar_support: bool = False
    grammar_cache_bytes: int = 512 * 2**20  # ours: compiled grammars kept for reuse (one may take an eighth)
    grammar_compile_timeout: float = 30.0  # ours: seconds one grammar may take to compile
    # prompt images (a vision model's): TGI's fetch cap (1 GiB); ours: fetch from private addresses too, most
    # images in one request (TGI has no limit; vLLM's --limit-mm-per-prompt); LightLLM --cache_capacity /
    # --cache_reserved_ratio: the encoder-output cache
    max_image_fetch_size: int = 1024 * 1024 * 1024
    allow_private_image_urls: bool = False
    max_images: int | None = None
    image_cache_capacity: int = 200
    image_cache_reserved_ratio: float = 0.5
    watermark_gamma: float | None = None
    watermark_delta: float | None = None
    # --- HTTP server ---
    hostname: str = "0.0.0.0"
    port: int = 3000
    prometheus_port: int = 9000
    cors_allow_origin: list[str] = field(default_factory=list)
    api_key: str | None = None
    graceful_termination_timeout: int = 90
    header_read_timeout: float = 30.0  # ours: hyper's header_read_timeout (slowloris connections are closed)
    # --- observability ---
    json_output: bool = False
    otlp_endpoint: str | None = None
    otlp_service_name: str = "text-generation-inference.router"
    usage_stats: str = "on"
    ngrok: bool = False
    ngrok_authtoken: str | None = None
    ngrok_edge: str | None = None
    # --- LightLLM options (python -m tgi_compat.api.cli.api_server; also launcher flags) ---
    eos_token_ids: list[int] = field(default_factory=list)  # extra ids that end generation (--eos_id)
    router_token_ratio: float = 0.0  # below this KV use, admission is optimistic
    router_max_new_token_len: int = 1024  # output length the optimistic estimate assumes
    long_truncation_mode: str | None = None  # "head" | "center": default of the request parameter
    token_healing: bool = False  # default of the request parameter `token_healing`
    return_all_prompt_logprobs: bool = False  # default of the request parameter
    beam_mode: bool = False  # LightLLM --beam_mode: best_of > 1 without sampling is a beam search of that width
    diverse_mode: bool = False  # LightLLM --diverse_mode: siblings decode with shared-prefix attention
    metric_gateway: str | None = None  # Pushgateway host:port (tgi_compat.api.server.ops_services)
    metric_job_name: str = "lightllm"
    metric_grouping_key: list[str] = field(default_factory=list)  # key=value items
    metric_push_interval: float = 10.0
    enable_monitor_auth: bool = False  # basic auth from env USERNAME / PASSWORD
    disable_log_stats: bool = False
    log_stats_interval: float | None = None  # seconds between stats lines; None: none (TGI)
    # --- how the engine runs ---
    engine_in_process: bool = False  # ours: run the engine in the API process (tests, debugging)
    enforce_eager: bool = False  # ours (vLLM's name): no decode CUDA graphs, whatever --cuda-graphs says
    overlap_scheduling: bool | None = None  # None: the engine's default (on for CUDA); AIAK --disable-async-output-proc
    chat_template: str | None = None  # ours: --chat-template FILE|STRING overrides the model's template
    served_model_name: str | None = None  # ours: the id /v1/models and OpenAI responses report
    health_monitor: bool = False  # LightLLM: restart a dead or hung engine instead of stopping the server

    def to_engine_config(self) -> EngineConfig:
        engine = EngineConfig(
            model_id=self.model_id,
            revision=self.revision,
            dtype=self.dtype,
            device=self.device,
            attention_backend=self.attention_backend,
            quantize=self.quantize,
            kv_cache_dtype=self.kv_cache_dtype,
            load_format=self.load_format,
            max_batch_total_tokens=self.max_batch_total_tokens,
            cuda_memory_fraction=self.cuda_memory_fraction,
            max_total_tokens=self.max_total_tokens,
            max_waiting_tokens=self.max_waiting_tokens,
            waiting_served_ratio=self.waiting_served_ratio,
            cuda_graphs=[] if self.enforce_eager else self.cuda_graphs,
            eos_token_ids=list(self.eos_token_ids),
            router_token_ratio=self.router_token_ratio,
            router_max_new_token_len=self.router_max_new_token_len,
            num_shard=self.num_shard,
            master_addr=self.master_addr,
            master_port=self.master_port,
            prefix_caching=self.prefix_caching,
            diverse_mode=self.diverse_mode,
            overlap_scheduling=self.overlap_scheduling,
            grammar_cache_bytes=self.grammar_cache_bytes,
            grammar_compile_timeout=self.grammar_compile_timeout,
            image_cache_capacity=self.image_cache_capacity,
            image_cache_reserved_ratio=self.image_cache_reserved_ratio,
            speculative=self.speculative,
        )
        self._lora_into(engine)
        if self.max_batch_prefill_tokens is not None:
            engine.max_batch_prefill_tokens = self.max_batch_prefill_tokens
        engine.max_mixed_prefill_tokens = self.max_mixed_prefill_tokens
        if self.max_batch_size is not None:
            engine.max_running_requests = self.max_batch_size
        return engine

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """ValueError: the flags contradict each other or the JSON is not a supported configuration."""
        if self.speculative_config is not None:
            if self.speculate is not None:
                raise ValueError("give --speculate or --speculative-config, not both")
            return SpeculativeConfig.from_vllm_json(self.speculative_config)
        return SpeculativeConfig.from_tgi(self.speculate) if self.speculate else None

    @property
    def lora_sources(self) -> list[LoraSource]:
        tgi = parse_tgi_lora_adapters(self.lora_adapters) if self.lora_adapters else []
        return tgi + [parse_lora_module(module) for module in self.lora_modules]

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_adapters) or bool(self.lora_modules)

    def _lora_into(self, engine: EngineConfig) -> None:
        if not self.lora_enabled:
            return
        sources = self.lora_sources
        engine.lora_adapters = sources
        engine.max_loras = self.max_loras or max(1, len(sources))
        engine.max_cpu_loras = self.max_cpu_loras or max(engine.max_loras, len(sources), 8)
        engine.max_lora_rank = self.max_lora_rank or (64 if self.lora_adapters else 16)


@dataclass(frozen=True, slots=True)
class ServingLimits:
    """The limits validation enforces, resolved once the engine has reported its capacity."""

    max_input_tokens: int
    max_total_tokens: int
    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int
    max_concurrent_requests: int
    max_client_batch_size: int

    @classmethod
    def resolve(cls, config: ServerConfig, engine_max_total_tokens: int) -> ServingLimits:
        max_total = config.max_total_tokens or engine_max_total_tokens
        max_input = config.max_input_tokens if config.max_input_tokens is not None else max_total - 1
        if max_input >= max_total:
            raise ValueError(f"`max_input_tokens`({max_input}) must be < `max_total_tokens`({max_total})")
        return cls(
            max_input_tokens=max_input,
            max_total_tokens=max_total,
            max_best_of=config.max_best_of,
            max_stop_sequences=config.max_stop_sequences,
            max_top_n_tokens=config.max_top_n_tokens,
            max_concurrent_requests=config.max_concurrent_requests,
            max_client_batch_size=config.max_client_batch_size,
        )
