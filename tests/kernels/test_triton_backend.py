"""TritonAttentionBackend inside a real ModelRunner (kernels interpreted on CPU) vs the torch backend."""

from __future__ import annotations

import pytest
import torch

from tgi_compat.modeling.cuda_graphs import DEFAULT_BATCH_SIZES, resolve_batch_sizes
from tgi_compat.modeling.forward_batch import build_forward_batch
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

MAX_LEN = 48


def make_runner(weights, backend: str) -> ModelRunner:
    hf_config, state_dict = weights
    cfg = RunnerConfig(
        device="cpu",
        dtype="float32",
        attention_backend=backend,
        num_kv_slots=4 * MAX_LEN,
        max_rows=4,
        max_seq_len=MAX_LEN,
        show_progress=False,
    )
    return ModelRunner.from_hf_state_dict(hf_config, state_dict, cfg)


def run_steps(runner: ModelRunner) -> list[torch.Tensor]:
    """A prefill of two prompts, a MIXED step (a chunk beside a decode), then two DECODE steps."""
    steps = [
        # request 0: 7-token prompt; request 1: first 5-token chunk of its prompt
        dict(input_ids=[3, 14, 15, 9, 2, 6, 5, 11, 12, 13, 14, 15], req_rows=[2, 0], q_lens=[7, 5], kv_lens=[7, 5]),
        # request 0 decodes one token while request 1 prefills its last 3 tokens over a 5-token prefix
        dict(input_ids=[40, 16, 17, 18], req_rows=[2, 0], q_lens=[1, 3], kv_lens=[8, 8]),
        dict(input_ids=[41, 42], req_rows=[2, 0], q_lens=[1, 1], kv_lens=[9, 9]),
        dict(input_ids=[43, 44], req_rows=[2, 0], q_lens=[1, 1], kv_lens=[10, 10]),
    ]
    logits = []
    for step in steps:
        slots = [
            row * MAX_LEN + pos
            for row, q, kv in zip(step["req_rows"], step["q_lens"], step["kv_lens"])
            for pos in range(kv - q, kv)
        ]
        last = torch.tensor(step["q_lens"]).cumsum(0) - 1
        batch = build_forward_batch(out_slots=slots, logits_indices=last.tolist(), **step)
        logits.append(runner.forward(batch))
    return logits


def test_triton_backend_matches_torch_backend_over_extend_mixed_and_decode_steps(tiny_weights):
    by_torch = run_steps(make_runner(tiny_weights, "torch"))
    triton_runner = make_runner(tiny_weights, "triton")
    backend, decode_prefixes = triton_runner.backend, []
    init = backend.init_forward_metadata

    def recording_init(batch, req_to_token):
        init(batch, req_to_token)
        decode_prefixes.append(backend.metadata.num_decode_prefix)

    backend.init_forward_metadata = recording_init
    by_triton = run_steps(triton_runner)
    # the MIXED step's leading decode (request 0) went through flash-decoding, the chunk through extend
    assert decode_prefixes == [0, 1, 0, 0]
    for expected, got in zip(by_torch, by_triton):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
    # the last step was a DECODE batch: it went through flash-decoding
    assert triton_runner.backend.metadata.is_decode and triton_runner.backend.metadata.num_splits >= 1


@pytest.mark.parametrize(
    ("flag", "enforce_eager", "expected"),
    [
        (None, False, [size for size in DEFAULT_BATCH_SIZES if size <= 256]),  # the default batch limit's
        ([], False, []),
        ([0], False, []),
        ([8, 1, 300, 4, 4], False, [1, 4, 8]),  # sorted, unique, capped at the batch limit
        ([1, 2], True, []),
    ],
)
def test_cuda_graph_batch_sizes_follow_tgi_flag_semantics(flag, enforce_eager, expected):
    assert resolve_batch_sizes(flag, enforce_eager, max_batch_size=256) == expected


def test_negative_cuda_graph_batch_size_is_rejected():
    with pytest.raises(ValueError):
        resolve_batch_sizes([4, -1], False, 256)


def test_graphs_stay_off_on_cpu_or_when_disabled():
    from tgi_compat.modeling.cuda_graphs import maybe_capture_decode_graphs

    class GraphSafeBackend:
        supports_cuda_graphs = True

    class EagerOnlyBackend:  # what AttentionBackend declares by default
        supports_cuda_graphs = False

    def never_called(batch):
        raise AssertionError("nothing may be captured here")

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    common = dict(max_batch_size=8, pad_row=8, pad_slot=100, max_seq_len=64)
    assert maybe_capture_decode_graphs(never_called, GraphSafeBackend(), None, device=cpu, **common) is None
    assert maybe_capture_decode_graphs(never_called, GraphSafeBackend(), [], device=cuda, **common) is None
    assert maybe_capture_decode_graphs(never_called, EagerOnlyBackend(), [1, 2], device=cuda, **common) is None


def fused_rotary_backend(fused: bool, heads: int, kv_heads: int, head_dim: int, max_len: int):
    """A 4-row TritonAttentionBackend (fp32, CPU) whose decode steps of 1-4 rows take the fused rotary or never do."""
    from tgi_compat.modeling.attention.base import AttentionShape
    from tgi_compat.modeling.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(
        AttentionShape(heads, kv_heads, head_dim, 4, max_len, torch.device("cpu"), torch.float32)
    )
    backend.fused_rotary_batches = range(1, 5) if fused else range(0)
    return backend


def one_token_step(rows: list[int], kv_lens: list[int], max_len: int, head_dim: int, gen: torch.Generator):
    """A decode step of one token per row (row r's tokens in slots [r * max_len, ...)): its batch, req_to_token and
    rope rows at random angles."""
    from tgi_compat.modeling.layers.triton_ops import triton_rope_tables

    batch = build_forward_batch(
        input_ids=[5] * len(rows),
        req_rows=rows,
        q_lens=[1] * len(rows),
        kv_lens=kv_lens,
        out_slots=[row * max_len + kv - 1 for row, kv in zip(rows, kv_lens)],
        logits_indices=list(range(len(rows))),
    )
    req_to_token = torch.arange(4 * max_len, dtype=torch.int32).view(4, max_len)
    angles = torch.rand(max_len, head_dim // 2, generator=gen) * 6.3
    return batch, req_to_token, triton_rope_tables(angles.cos(), angles.sin(), batch.positions)


@pytest.mark.parametrize("num_requests", [1, 2])
def test_fused_rotary_decode_matches_separate_rotary_kv_store_and_attention(num_requests: int):
    """rotate_store_and_attend with the fused kernel (rotary + KV store + merged splits in one launch)
    gives the output and KV cache of the separate rotary + KV-store kernel and flash-decoding."""
    from tgi_compat.modeling.attention.base import AttentionParams, LayerQKV
    from tgi_compat.modeling.layers.triton_ops import TRITON_OPS

    heads, kv_heads, head_dim, max_len = 8, 2, 16, 40
    gen = torch.Generator().manual_seed(num_requests)
    batch, req_to_token, rope = one_token_step([2, 0][:num_requests], [33, 20][:num_requests], max_len, head_dim, gen)
    qkv = torch.randn(num_requests, heads + 2 * kv_heads, head_dim, generator=gen)
    caches = torch.randn(2, 4 * max_len, kv_heads, head_dim, generator=gen)
    results = []
    for fused in (True, False):
        backend = fused_rotary_backend(fused, heads, kv_heads, head_dim, max_len)
        backend.merged_split_batches = range(1, 5)
        backend.init_forward_metadata(batch, req_to_token)
        backend.metadata.block_n = 16  # short blocks: these contexts span several splits, merged in-kernel
        assert backend.metadata.num_splits > 1
        k_cache, v_cache = caches[0].clone(), caches[1].clone()
        qk, v = qkv[:, : heads + kv_heads].clone(), qkv[:, heads + kv_heads :]
        params = AttentionParams(head_dim**-0.5)
        out = backend.rotate_store_and_attend(LayerQKV(qk, v, rope, TRITON_OPS, k_cache, v_cache), params)
        results.append((out, k_cache, v_cache))
        # the fused kernel rotates in registers and leaves qk as it was; the separate rotary turns it in place
        assert torch.equal(qk, qkv[:, : heads + kv_heads]) == fused
        assert not backend._split_counter.any()
    (fused, k_fused, v_fused), (separate, k_sep, v_sep) = results
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_fused, k_sep, rtol=1e-6, atol=1e-6)
    assert torch.equal(v_fused, v_sep)


def test_lora_op_set_takes_the_fused_rotary():
    """A LoRA-enabled server's layers hand attention LoRA's op set (lora_layer_ops around the Triton ops): its decode
    steps take the fused rotary + KV store + flash-decoding, equal to the separate kernels. (The choice once matched
    the op set's name, which LoRA's wrapper changes, and no LoRA server's decode fused its rotary.)"""
    from tgi_compat.modeling.attention.base import AttentionParams, LayerQKV
    from tgi_compat.modeling.layers.triton_ops import TRITON_OPS
    from tgi_compat.modeling.lora.layer_ops import LoraContext, lora_layer_ops

    heads, kv_heads, head_dim, max_len = 8, 2, 16, 40
    gen = torch.Generator().manual_seed(7)
    batch, req_to_token, rope = one_token_step([2, 0, 3], [33, 20, 9], max_len, head_dim, gen)
    qkv = torch.randn(3, heads + 2 * kv_heads, head_dim, generator=gen)
    caches = torch.randn(2, 4 * max_len, kv_heads, head_dim, generator=gen)
    ops = lora_layer_ops(TRITON_OPS, LoraContext(), {})
    results = []
    for fused in (True, False):
        backend = fused_rotary_backend(fused, heads, kv_heads, head_dim, max_len)
        backend.init_forward_metadata(batch, req_to_token)
        k_cache, v_cache = caches[0].clone(), caches[1].clone()
        qk, v = qkv[:, : heads + kv_heads].clone(), qkv[:, heads + kv_heads :].clone()
        new = LayerQKV(qk, v, rope, ops, k_cache, v_cache)
        decode, fused_calls = backend._decode, []

        def recording_decode(*args, decode=decode, fused_calls=fused_calls, **kwargs):
            fused_calls.append(kwargs.get("new_token") is not None)
            return decode(*args, **kwargs)

        backend._decode = recording_decode
        results.append((backend.rotate_store_and_attend(new, AttentionParams(head_dim**-0.5)), k_cache, v_cache))
        assert fused_calls == [fused]
    (fused, k_fused, v_fused), (separate, k_sep, v_sep) = results
    assert not torch.equal(k_sep, caches[0])  # the new tokens went in
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_fused, k_sep, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_fused, v_sep, rtol=1e-5, atol=1e-5)


def test_graph_replay_carries_the_prefix_group_table():
    """--diverse_mode: the static inputs hold a group table; a replay copies the step's (or a no-group one) and the
    bucket's padding rows are in no group. The graphs' replays are stood in for by eager calls on the static batch."""
    from tgi_compat.modeling.cuda_graphs import DecodeCudaGraphs
    from tgi_compat.modeling.forward_batch import PrefixGroups

    seen: list[list[list[int]]] = []

    def step_fn(batch):
        assert batch.prefix_groups is not None
        seen.append(batch.prefix_groups.table.tolist())
        return torch.zeros(batch.batch_size, 3)

    graphs = DecodeCudaGraphs(step_fn, [4], pad_row=8, pad_slot=100, max_seq_len=64, device="cpu", prefix_group_max=2)

    class EagerGraph:
        def replay(self) -> None:
            graphs.outputs[4, False] = graphs.graph_step(4, with_lora=False)()

    graphs.graphs[4, False] = EagerGraph()  # type: ignore[assignment]
    step = build_forward_batch([5, 6, 7], [0, 1, 2], [1, 1, 1], [9, 9, 4], [20, 21, 22], [0, 1, 2])
    step.prefix_groups = PrefixGroups(torch.tensor(PrefixGroups.rows([(8, [1, 0])], 3, 2)))
    graphs.replay(step)
    assert seen[-1] == [[8, 1, 0], [8, -1, -1], [0, -1, -1], [0, -1, -1]]
    step.prefix_groups = None  # a decode step built without groups: replayed as no group at all
    graphs.replay(step)
    assert seen[-1] == [[0, -1, -1]] * 4


def test_default_cuda_graphs_reach_a_larger_batch_limit():
    # 512 rows of an 8B model eager cost more host time than a diverse-mode step's kernels: captured too
    assert resolve_batch_sizes(None, False, max_batch_size=512)[-4:] == [320, 384, 448, 512]
