"""The static input buffers a captured step graph reads (cuda_graphs.py): one set per graph family, sized for
its largest bucket, that a replay overwrites with the step's rows before it launches the graph."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgi_compat.modeling.forward_batch import ForwardBatch, ForwardMode, PrefixGroups


@dataclass
class StaticInputs:
    """Inputs of the largest bucket, q tokens per request; a bucket of size b uses the first b requests
    (the first b * q tokens)."""

    tokens_per_row: int  # q: 1 for decode steps, k + 1 for verify steps
    input_ids: torch.Tensor  # [N * q] int64
    positions: torch.Tensor  # [N * q] int64
    out_slots: torch.Tensor  # [N * q] int64
    req_rows: torch.Tensor  # [N] int64
    q_start: torch.Tensor  # [N] int64, arange * q
    q_lens: torch.Tensor  # [N] int64, all q
    kv_lens: torch.Tensor  # [N] int64
    logits_indices: torch.Tensor  # [N * q] int64
    lora_slots: torch.Tensor  # [N] int64: each request's adapter slot, -1 for base and padding rows (LoRA graphs)
    # --diverse_mode: the shared-prefix group table [N, 1 + group_max] int64 (PrefixGroups); None: off
    prefix_table: torch.Tensor | None = None
    # an M-RoPE model (Qwen2.5-VL): its t/h/w rotary rows [3, N * q] int64; None: rotary by `positions`
    rope_positions: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls, size: int, tokens_per_row: int, device: torch.device, prefix_group_max: int = 0, mrope: bool = False
    ) -> StaticInputs:
        num_tokens = size * tokens_per_row

        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)

        arange = torch.arange(size, dtype=torch.int64, device=device)
        inputs = cls(
            tokens_per_row,
            zeros(num_tokens),
            zeros(num_tokens),
            zeros(num_tokens),
            zeros(size),
            arange * tokens_per_row,
            torch.full_like(arange, tokens_per_row),
            zeros(size),
            torch.arange(num_tokens, dtype=torch.int64, device=device),
            zeros(size) - 1,
        )
        if prefix_group_max:
            inputs.prefix_table = torch.zeros(size, 1 + prefix_group_max, dtype=torch.int64, device=device)
        if mrope:
            inputs.rope_positions = torch.zeros(3, num_tokens, dtype=torch.int64, device=device)
        return inputs

    def clear_groups(self, start: int, end: int | None) -> None:
        """Rows start..end in no shared-prefix group (prefix length 0, no members)."""
        if self.prefix_table is not None:
            self.prefix_table[start:end, 0] = 0
            self.prefix_table[start:end, 1:] = -1

    def batch(self, size: int, max_seq_len: int) -> ForwardBatch:
        q = self.tokens_per_row
        mode = ForwardMode.DECODE if q == 1 else ForwardMode.EXTEND
        return self.view(mode, size * q, size, size * q, q, max_seq_len)

    def view(
        self,
        mode: ForwardMode,
        num_tokens: int,
        num_requests: int,
        num_logits: int,
        max_q_len: int,
        max_seq_len: int,
        decode_prefix: int | None = None,
    ) -> ForwardBatch:
        """The batch a graph records over the first tokens and requests of the buffers."""
        return ForwardBatch(
            mode=mode,
            input_ids=self.input_ids[:num_tokens],
            positions=self.positions[:num_tokens],
            out_slots=self.out_slots[:num_tokens],
            req_rows=self.req_rows[:num_requests],
            q_start=self.q_start[:num_requests],
            q_lens=self.q_lens[:num_requests],
            kv_lens=self.kv_lens[:num_requests],
            logits_indices=self.logits_indices[:num_logits],
            max_q_len=max_q_len,
            max_kv_len=max_seq_len,  # graph-safe backends must not size anything from this
            prefix_groups=None if self.prefix_table is None else PrefixGroups(self.prefix_table[:num_requests]),
            rope_positions=None if self.rope_positions is None else self.rope_positions[:, :num_tokens],
            decode_prefix=decode_prefix,
        )
