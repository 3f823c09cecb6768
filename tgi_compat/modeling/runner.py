"""ModelRunner: a flat token batch in, float32 logits for the requested rows out.

NOTE: keep this file minimal (as vLLM's V2 runner asks of itself). It owns the model, the KV
buffers and the req_to_token table, and runs one step; everything else lives elsewhere: weight
formats in weights/, attention in attention/, layer ops in layers/, CUDA graphs in cuda_graphs.py,
scheduling and sampling in tgi_compat/router/.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn

from tgi_compat.modeling.attention import create_backend
from tgi_compat.modeling.attention.base import AttentionParams, AttentionShape
from tgi_compat.modeling.aux_hidden import attach_aux_hidden
from tgi_compat.modeling.config import ModelConfig
from tgi_compat.modeling.cuda_graphs import (
    StepGraphs,
    maybe_capture_decode_graphs,
    maybe_capture_verify_graphs,
    resolve_batch_sizes,
    verify_batch_sizes,
)
from tgi_compat.modeling.dtypes import default_device, default_dtype, resolve_dtype, resolve_kv_dtype
from tgi_compat.modeling.forward_batch import PREFIX_GROUP_MAX, ForwardBatch, ForwardMode
from tgi_compat.modeling.layers.ops import select_ops
from tgi_compat.modeling.layers.quantization import build_with
from tgi_compat.modeling.layers.quantization.select import resolve_quantization
from tgi_compat.modeling.mixed_graphs import maybe_capture_mixed_graphs
from tgi_compat.modeling.models.base import CausalLM, PoolingLM
from tgi_compat.modeling.parallel import NO_TP, TensorParallel, shard_heads
from tgi_compat.modeling.parallel.cross_broadcast import CrossKeysFollower
from tgi_compat.modeling.parallel.step_broadcast import StepBroadcast
from tgi_compat.modeling.parallel.vocab_logits import GreedyChoice, VocabParallelLogits
from tgi_compat.modeling.pooler import sentence_transformers_pooler
from tgi_compat.modeling.registry import NATIVE, is_pooling_model, modeling_path, resolve_model_class
from tgi_compat.modeling.source import ModelSource, resolve_model_source
from tgi_compat.modeling.step_profiler import StepProfiler
from tgi_compat.modeling.vision.cross_keys import cross_attention_keys
from tgi_compat.modeling.weights.lazy import LazyTensor
from tgi_compat.modeling.weights.loader import iterate_weights, load_model_config

if TYPE_CHECKING:
    from tgi_compat.modeling.lora.manager import LoraManager
    from tgi_compat.modeling.vision.encoder import ImageEncoder

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_SLOTS = 16384
# Left free on the GPU for activations and logits when sizing the KV cache from free memory.
ACTIVATION_RESERVE_BYTES = 1 << 30  # allocator slack, CUDA graph pools, cuBLAS workspaces


@dataclass(slots=True)
class RunnerConfig:
    model_id: str | None = None  # folder, .gguf path or hub id; None: the default model
    revision: str | None = None
    dtype: str | None = None  # float32 | float16 | bfloat16; None: float32 on CPU, bfloat16 on CUDA
    device: str | None = None  # None: cuda when available, else cpu
    attention_backend: str | None = None  # torch | triton; None: triton on CUDA, torch on CPU
    num_kv_slots: int | None = None  # KV capacity in tokens; None: from free memory (CUDA) or a fixed default
    memory_fraction: float = 1.0  # share of the free memory after weights that the KV cache may take
    max_rows: int = 256  # concurrent requests (rows of req_to_token)
    max_seq_len: int | None = None  # per-request tokens; None: min(model context, num_kv_slots)
    # Decode batch sizes to capture as CUDA graphs (TGI --cuda-graphs): None = TGI's default list,
    # [] = eager. Ignored off CUDA and with backends that are not graph-safe.
    cuda_graph_batch_sizes: list[int] | None = None
    max_prefill_tokens: int = 4096  # new tokens of the largest step: sizes the activation reserve
    show_progress: bool = True
    # --quantize: fp8 | eetq | weight_only_int8 quantize while loading; awq | gptq | compressed-tensors
    # name the checkpoint's own scheme. A quantized checkpoint's config.json decides in any case.
    quantize: str | None = None
    # KV cache element type: None/"auto" = the model's dtype; fp8 | fp8_e4m3 | fp8_e4m3fn | fp8_e5m2 store
    # K and V in one byte (unit scale, vLLM's default without calibrated scales): twice the tokens
    kv_cache_dtype: str | None = None
    # vLLM --load-format: "auto" reads the checkpoint; "dummy" makes random weights of its names and
    # shapes on the device (config.json and a tokenizer are all the folder needs)
    load_format: str = "auto"
    # LoRA: adapter slots on the device (vLLM --max-loras; 0: LoRA off, no LoRA work anywhere) and their rank cap
    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int = 0  # adapters staged in host memory at once (page-locked when LoRA starts)
    # Speculative decoding's drafts per request (0: off): verify steps of 2..k+1 tokens per request are captured
    # as CUDA graphs too, beside the decode graphs
    num_speculative_tokens: int = 0
    # --max-mixed-prefill-tokens: steps where decodes run beside at most this many prompt tokens replay CUDA graphs
    # too (tgi_compat/modeling/mixed_graphs.py); None: such steps run eager
    mixed_prefill_tokens: int | None = None
    # --diverse_mode: decode steps bring shared-prefix groups (ForwardBatch.prefix_groups), CUDA graphs included
    diverse_mode: bool = False
    # EAGLE-3: each step also writes these layers' output (aux_hidden.py; None: off); KV leaves room for the head
    aux_hidden_layers: tuple[int, ...] | None = None
    reserve_bytes: int = 0
    # a vision model's encoder-output cache (tgi_compat/router/image_cache.py): its rows stay on the device
    image_cache_bytes: int = 0


class ModelRunner:
    def __init__(
        self,
        cfg: RunnerConfig,
        model_config: ModelConfig | None = None,
        weights: Iterable[tuple[str, torch.Tensor | LazyTensor]] | None = None,
        tp: TensorParallel = NO_TP,
    ):
        """Loads from cfg.model_id, or (tests) from an already-built config and weight iterable.
        tp: this rank's tensor-parallel group; the model holds this rank's shard of every weight."""
        self.cfg = cfg
        self.tp = tp
        self.source: ModelSource | None = None
        self.device = tp.device if tp.is_sharded else torch.device(cfg.device or default_device())
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        if model_config is None:
            self.source = resolve_model_source(cfg.model_id, cfg.revision)
            model_config = load_model_config(self.source, cfg.load_format)
            weights = iterate_weights(
                self.source,
                model_config,
                cfg.show_progress,
                lazy=tp.is_sharded,
                load_format=cfg.load_format,
                device=self.device,
                dtype=self.dtype,
            )
        elif weights is None:
            raise ValueError("a model_config comes with its weights")
        self.model_config = model_config
        self.modeling_path = modeling_path(model_config.architecture)
        self.is_pooling = is_pooling_model(model_config.architecture)
        self.heads = shard_heads(model_config.num_heads, model_config.num_kv_heads, tp)
        self.kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, self.dtype)
        self.model = self._build_model(weights)
        # EAGLE-3's input: attached before the CUDA graphs are captured, so that they write it too
        max_aux_rows = cfg.max_prefill_tokens + cfg.max_rows * (cfg.num_speculative_tokens + 1)
        layers = cfg.aux_hidden_layers
        self.aux_hidden = None if layers is None else attach_aux_hidden(self.model, layers, max_aux_rows, self.dtype)
        self.lora = self._enable_lora() if cfg.max_loras else None
        self.image_encoder = self._image_encoder()  # None: a text model
        # a cross-attending model's (Mllama) image keys (tgi_compat.router.cross_attention): room taken from the KV's
        kv_budget = self._kv_budget_bytes()
        self.cross_attention = cross_attention_keys(self.model_config, self.model, kv_budget)
        self.num_kv_slots = tp.min_over_ranks(self._num_kv_slots(kv_budget))
        # Rank 0 of a sharded model: each forward first sends its batch to the other ranks.
        self.step_sender: StepBroadcast | None = None
        self.vocab_logits = VocabParallelLogits(tp, model_config.vocab_size) if tp.is_sharded else None
        self.step_profiler = StepProfiler.from_env(tp.rank)
        self.max_rows = cfg.max_rows
        self.max_seq_len = cfg.max_seq_len or min(self.model.max_positions, self.num_kv_slots)
        if self.max_seq_len > self.model.max_positions:
            raise ValueError(
                f"max_seq_len={self.max_seq_len} exceeds the {self.model.max_positions} positions the model supports"
            )
        # One spare KV slot (index num_kv_slots) and one spare row (index max_rows), never handed out
        # by the router: CUDA-graph padding entries write there.
        self.kv_caches = self._allocate_kv_caches()
        # req_to_token[row, position] -> KV slot of that token of the request in that row
        self.req_to_token = torch.zeros(self.max_rows + 1, self.max_seq_len, dtype=torch.int32, device=self.device)
        shape = AttentionShape(
            self.heads.num_heads,
            self.heads.num_kv_heads,
            model_config.head_dim,
            self.max_rows,
            self.max_seq_len,
            self.device,
            self.dtype,
            prefix_group_max=PREFIX_GROUP_MAX if cfg.diverse_mode else 0,
        )
        self.backend = create_backend(cfg.attention_backend, shape)
        if self.device.type == "cuda":
            image_spans = self.image_encoder is not None and self.image_encoder.bidirectional
            self.backend.compile_kernels(self.kv_caches[0], self.req_to_token, self._attention_params(), image_spans)
        self.cuda_graphs = maybe_capture_decode_graphs(
            self._forward_eager,
            self.backend,
            # transformers' modeling may sync with the host mid-step: no graphs on the fallback path; a pooling
            # model never decodes
            cfg.cuda_graph_batch_sizes if self.modeling_path == NATIVE and not self.is_pooling else [],
            max_batch_size=self.max_rows,
            pad_row=self.max_rows,
            pad_slot=self.num_kv_slots,
            max_seq_len=self.max_seq_len,
            device=self.device,
            lora=self.lora,  # LoRA decode steps get graphs of their own
            prefix_group_max=shape.prefix_group_max,
            mrope=model_config.rope_scaling.mrope_section is not None,  # Qwen2.5-VL's decodes replay with rope rows
        )
        # q tokens per request -> that verify step's graphs (empty: speculation off, or decode runs eager)
        self.verify_graphs = maybe_capture_verify_graphs(
            self._forward_eager, self.cuda_graphs, cfg.num_speculative_tokens, self.max_seq_len
        )
        self.mixed_graphs = maybe_capture_mixed_graphs(
            self._forward_eager,
            self.cuda_graphs,
            cfg.mixed_prefill_tokens,
            plain_steps=self.lora is None and self.aux_hidden is None,
        )

    @property
    def verify_graph_max_batch(self) -> int:
        """The largest batch of verify steps replayed as a CUDA graph (0: none)."""
        return min((graphs.max_batch_size for graphs in self.verify_graphs.values()), default=0)

    @classmethod
    def from_hf_state_dict(
        cls, hf_config: dict[str, Any], state_dict: dict[str, torch.Tensor], cfg: RunnerConfig | None = None
    ) -> ModelRunner:
        """A runner over in-memory weights (transformers config dict + state dict), for tests."""
        cfg = cfg or RunnerConfig(device="cpu", dtype="float32", num_kv_slots=4096, max_rows=16)
        return cls(cfg, ModelConfig.from_hf_dict(hf_config), state_dict.items())

    @property
    def pooling_task(self) -> str | None:
        """A pooling model's task ("embed", "classify", "reward"); None for a generating model."""
        return cast(PoolingLM, self.model).task if self.is_pooling else None

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor | GreedyChoice:
        """Logits [R, vocab] for the rows batch.logits_indices of the flat batch, in the weights' dtype (float32
        where a family soft-caps them); the sampler widens them to float32 where it needs to. A sharded model
        answers a `greedy_only` batch with each row's greedy choice instead (its logits are never gathered).

        Read (sample from) them before the next forward: a CUDA-graph replay reuses their memory.
        """
        if self.step_profiler is not None:
            self.step_profiler.before_step()
        if self.step_sender is not None:
            self.step_sender.send(batch)
        write_cached_prefixes(self.req_to_token, batch)
        graphs = self._graphs_for(batch)
        if self.lora is not None:
            self.lora.begin_step(batch, replayed=graphs is not None)
        logits = graphs.replay(batch) if graphs is not None else self._forward_eager(batch)
        if self.vocab_logits is None:
            return logits
        # this rank's vocabulary block: its gather (or the greedy choice's) runs here, outside the CUDA graphs,
        # which can then serve both kinds of step
        return self.vocab_logits.greedy(logits) if batch.greedy_only else self.vocab_logits.gather(logits)

    def _graphs_for(self, batch: ForwardBatch) -> StepGraphs | None:
        """The graph set that replays this step (decode graphs, the verify graphs of its q, or the mixed-step
        graphs), None: eager."""
        graphs: StepGraphs | None
        if batch.mode == ForwardMode.MIXED:
            graphs = self.mixed_graphs
        else:
            graphs = self.cuda_graphs if batch.max_q_len == 1 else self.verify_graphs.get(batch.max_q_len)
        return graphs if graphs is not None and graphs.can_run(batch) else None

    @torch.inference_mode()
    def pool(self, batch: ForwardBatch) -> torch.Tensor:
        """A pooling model's [B, output] float32 (each request's embedding or head scores) for a step whose requests
        bring their whole prompt (kv_lens == q_lens): the hidden states of every prompt token are read."""
        if not self.is_pooling:
            raise TypeError(f"{self.model_config.architecture} is not a pooling model")
        if self.step_sender is not None:  # the other ranks run the sharded decoder beside this one
            self.step_sender.send(batch)
        write_new_slots(self.req_to_token, batch)
        self.backend.init_forward_metadata(batch, self.req_to_token)
        hidden = self.model(batch.input_ids, batch.positions, batch, self.kv_caches, self.backend)
        return cast(PoolingLM, self.model).pool(hidden, batch).float()

    def _forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        write_new_slots(self.req_to_token, batch)
        self.backend.init_forward_metadata(batch, self.req_to_token)
        hidden = self.model(batch.input_ids, batch.positions, batch, self.kv_caches, self.backend)
        return self.model.compute_logits(hidden[batch.logits_indices])

    def follow_rank_zero(self, steps: StepBroadcast) -> None:
        """Ranks > 0: run the forward of every batch rank 0 sends (a pooling model's: its pool, which rank 0 sends
        every step of; its output here is dropped, as the logits are) and keep the adapters it loads, until it sends
        stop."""
        step = self.pool if self.is_pooling else self.forward
        if self.cross_attention is not None:  # a cross-attending model: each rank makes its own image keys
            steps.cross_keys = CrossKeysFollower(self.cross_attention.projector)
        while (message := steps.receive()) is not None:
            if isinstance(message, ForwardBatch):
                step(message)
            else:
                assert self.lora is not None  # rank 0 sends adapters only with LoRA on, as every rank has it
                self.lora.follow(message)

    def close(self) -> None:
        """Rank 0: release the other ranks from follow_rank_zero. The group is left by exiting the process
        (tgi_compat.router.process_exit): NCCL's `destroy_process_group` could block there for good."""
        if self.step_sender is not None:
            self.step_sender.send_stop()
            self.step_sender = None

    def _build_model(self, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]]) -> CausalLM:
        # imported here, like the model class: importing Triton kernels at module import would fix
        # their mode before tests can choose the interpreter
        from tgi_compat.modeling.layers.linear import process_weights_after_loading

        config = self.model_config
        model_cls = resolve_model_class(config.multimodal_architecture or config.architecture)
        quantization = resolve_quantization(self.cfg.quantize, self.model_config.quantization_config)
        if quantization is not None:
            logger.info("Weight quantization: %s", quantization.name)
        sharding = {}
        if self.tp.is_sharded:
            if not model_cls.supports_tensor_parallel:
                raise ValueError(f"{model_cls.__name__} does not support tensor parallelism (--num-shard > 1)")
            sharding = {"tp": self.tp}
        with torch.device(self.device), default_dtype(self.dtype), build_with(quantization):
            model = model_cls(self.model_config, select_ops(self.device), **sharding)
        model.load_weights(weights)
        if self.is_pooling and self.source is not None:  # a sentence-transformers folder names its pooling
            pooling = cast(PoolingLM, model)
            pooling.pooler = sentence_transformers_pooler(self.source.folder) or pooling.pooler
        assert isinstance(model, nn.Module), model_cls  # every model family is a torch module
        process_weights_after_loading(model)
        # Loading may leave device temporaries in the caching allocator (dummy weights, quantizing):
        # hand them back before the KV pool is sized from the free memory
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return model.eval()

    def _image_encoder(self) -> ImageEncoder | None:
        if self.model_config.multimodal_architecture is None or self.source is None:
            return None
        from tgi_compat.modeling.vision.encoder import ImageEncoder, VisionLanguageModel

        # the registry serves every multimodal wrapper with its vision encoder (models/gemma3_vision.py)
        return ImageEncoder(cast(VisionLanguageModel, self.model), self.source.folder, self.device)

    def _enable_lora(self) -> LoraManager:
        from tgi_compat.modeling.lora.manager import LoraManager  # imports the kernels: see _build_model

        with torch.device(self.device), default_dtype(self.dtype):
            return LoraManager(self.model, self.cfg.max_loras, self.cfg.max_lora_rank, self.cfg.max_cpu_loras)

    def _attention_params(self) -> list[AttentionParams]:
        """The distinct per-layer attention switches of the native model (kernel variants follow them)."""
        from tgi_compat.modeling.models.decoder import Attention  # imports the kernels: see _build_model

        distinct: list[AttentionParams] = []
        for module in self.model.modules():
            if isinstance(module, Attention) and module.params not in distinct:
                distinct.append(module.params)
        return distinct

    def _kv_bytes_per_token(self) -> int:
        c = self.model_config
        return 2 * c.num_layers * self.heads.num_kv_heads * c.head_dim * self.kv_dtype.itemsize

    def _activation_reserve_bytes(self) -> int:
        """Transient memory a step may need beside weights and KV. Without it a KV pool sized to the
        last byte makes the first large step fail with OOM (seen on an H200 at 256 rows)."""
        c = self.model_config
        # the largest prefill: residual, qkv, attention out, gate|up and its product, per token
        prefill = self.cfg.max_prefill_tokens * (6 * c.hidden_size + 3 * c.intermediate_size) * self.dtype.itemsize
        # float32 logits and the sampler's work copies: one row per request, or per prompt token
        # when prompt logprobs are asked for
        logit_rows = max(self.cfg.max_rows, self.cfg.max_prefill_tokens)
        sampling = 3 * logit_rows * c.vocab_size * 4
        images = 0 if self.image_encoder is None else self.cfg.image_cache_bytes
        return (
            ACTIVATION_RESERVE_BYTES + prefill + sampling + self._graph_logits_bytes() + self.cfg.reserve_bytes + images
        )

    def _graph_logits_bytes(self) -> int:
        """The CUDA graphs' logits: each bucket's output stays allocated in the graph pool (float32 counted, as
        where a family soft-caps). Decode graphs (twice with LoRA: its steps have graphs of their own) and, with
        speculation on, the verify graphs of each draft length."""
        if self.modeling_path != NATIVE or self.is_pooling:  # (no graphs: runner.py captures for neither)
            return 0
        decode = resolve_batch_sizes(self.cfg.cuda_graph_batch_sizes, False, self.cfg.max_rows)
        rows = sum(decode) * (2 if self.cfg.max_loras else 1)
        k = self.cfg.num_speculative_tokens
        if k >= 1:
            rows += sum(verify_batch_sizes(decode)) * sum(range(2, k + 2))
        return rows * self.model_config.vocab_size * 4

    def _kv_budget_bytes(self) -> float | None:
        """The device memory the KV cache may take; None where its size is not read from the free memory."""
        if self.cfg.num_kv_slots or self.device.type != "cuda":
            return None
        free_bytes, _ = torch.cuda.mem_get_info(self.device)
        return free_bytes * self.cfg.memory_fraction - self._activation_reserve_bytes()

    def _num_kv_slots(self, budget: float | None) -> int:
        """The KV cache's token slots in `budget` bytes (_kv_budget_bytes; None: the configured or CPU count)."""
        if budget is None:
            return self.cfg.num_kv_slots or CPU_DEFAULT_KV_SLOTS
        budget -= 0 if self.cross_attention is None else self.cross_attention.reserved_bytes
        num_slots = int(budget // self._kv_bytes_per_token())
        if num_slots <= 0:
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
            raise RuntimeError(f"no GPU memory left for the KV cache ({free_bytes / 2**30:.2f} GiB free after weights)")
        return num_slots

    def _allocate_kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.model_config
        bytes_per_token = self._kv_bytes_per_token()
        logger.info(
            "KV cache: %d tokens of %s (%.2f GiB, %d bytes/token)",
            self.num_kv_slots,
            str(self.kv_dtype).removeprefix("torch."),
            self.num_kv_slots * bytes_per_token / 2**30,
            bytes_per_token,
        )
        shape = (self.num_kv_slots + 1, self.heads.num_kv_heads, c.head_dim)
        return [
            (
                torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
            )
            for _ in range(c.num_layers)
        ]


def write_cached_prefixes(req_to_token: torch.Tensor, batch: ForwardBatch) -> None:
    """The step's prefix-cache hits into their rows (their K/V is cached: no forward writes them)."""
    if batch.cached_prefix_slots is not None:
        rows, positions, slots = batch.cached_prefix_slots
        req_to_token[rows, positions] = slots.to(torch.int32)


def write_new_slots(req_to_token: torch.Tensor, batch: ForwardBatch) -> None:
    """The slot of every token the step computes into its request's row."""
    if batch.mode == ForwardMode.DECODE:
        token_rows = batch.req_rows
    else:
        token_rows = torch.repeat_interleave(batch.req_rows, batch.q_lens, output_size=batch.num_tokens)
    req_to_token[token_rows, batch.positions] = batch.out_slots.to(torch.int32)
