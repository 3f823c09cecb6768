"""Gemma 3 with images on the Triton backend (interpreted): a step whose image placeholders attend to each
other both ways gives the extend kernel each token's span, the decodes take flash-decoding; logits equal
transformers' within 1e-3 (fp32), the prompt's chunks, then decode steps over it. Through the engine, chunked:
mixed steps of one request's decode and another's image chunk give transformers' greedy ids."""

from __future__ import annotations

import pytest
import torch

from tests.modeling.helpers import max_rel_error
from tests.modeling.test_gemma3_multimodal import tiny_multimodal
from tests.modeling.test_gemma3_vision import VOCAB, pixels, prompt, reference_logits, run, text
from tests.router import test_gemma3_vision_engine as engine_test
from tests.router.test_gemma3_vision_engine import GREEN, RED, checkpoint  # noqa: F401 - (a fixture)
from tgi_compat.modeling.attention.base import AttentionParams, AttentionShape
from tgi_compat.modeling.attention.triton_backend import TritonAttentionBackend
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig


def test_images_on_the_triton_backend_equal_transformers(tmp_path):
    model = tiny_multimodal(VOCAB)
    model.save_pretrained(tmp_path)
    config = RunnerConfig(
        model_id=str(tmp_path), device="cpu", dtype="float32", attention_backend="triton", num_kv_slots=256,
        max_rows=4, show_progress=False,
    )  # fmt: skip
    runner = ModelRunner(config)
    assert runner.image_encoder is not None and runner.image_encoder.bidirectional  # compile_kernels opens spans
    pixel_values = pixels((200, 30, 60), (10, 220, 90))
    ids = prompt(text(1, 5), text(2, 6), text(3, 4))
    features = runner.model.encode_images(pixel_values)
    slots = list(range(10, 10 + len(ids)))
    ref = reference_logits(model, ids, pixel_values)
    cut = len(ids) - 3
    chunks = [run(runner, ids[:cut], 0, slots, features)]  # both images, bidirectional
    spans = runner.backend.metadata.spans
    assert spans is not None and int((spans[:, 1] > spans[:, 0]).sum()) > 0  # the kernel opened the images' spans
    chunks += [run(runner, ids[: p + 1], p, slots, features) for p in range(cut, len(ids))]  # decode steps
    assert runner.backend.metadata.spans is None  # the last steps had no image
    assert max_rel_error(torch.cat(chunks), ref) <= 1e-3


def test_chunked_image_prompts_through_the_engine_give_transformers_greedy_ids(checkpoint):  # noqa: F811
    engine = engine_test.make_engine(checkpoint[2], max_batch_prefill_tokens=11, attention_backend="triton")
    both, ids = engine_test.request("both", [RED, GREEN])
    red, red_ids = engine_test.request("red", [RED])
    events = engine_test.run(engine, both, red)
    assert engine_test.token_ids(events["both"]) == engine_test.expected(checkpoint, ids, [RED, GREEN])
    assert engine_test.token_ids(events["red"]) == engine_test.expected(checkpoint, red_ids, [RED])


def test_the_span_warm_up_writes_no_cache_row():
    """compile_kernels' image-span prefills (each layer kind's, at start-up on a GPU) read the cache and write only
    scratch: a KV cache full of values stays as it was."""
    shape = AttentionShape(4, 2, 16, 2, 32, torch.device("cpu"), torch.float32)
    backend = TritonAttentionBackend(shape)
    k_cache, v_cache = torch.randn(2, 64, 2, 16).unbind(0)
    before = k_cache.clone(), v_cache.clone()
    req_to_token = torch.randint(0, 64, (3, 32), dtype=torch.int32)
    params = [AttentionParams(0.25, sliding_window=4, softcap=30.0), AttentionParams(0.25)]
    backend.compile_kernels((k_cache, v_cache), req_to_token, params, image_spans=True)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.parametrize("window", [None, 4])
def test_a_mixed_step_opens_each_image_span_at_its_own_tokens(window):
    """A MIXED step: two decodes first (flash-decoding), then a request whose new tokens hold an image span (the
    extend kernel). The kernel reads each token's span by its row of the whole step, decodes counted: the step
    equals the reference. (Spans cut to the extend requests alone were read one decode row early, past their
    end: PaliGemma 2's chunked prompts on an H100, session 36.)"""
    from tgi_compat.kernels.attention.prefill import prefill_attention_ref, token_spans
    from tgi_compat.modeling.forward_batch import ImageEmbeds, build_forward_batch

    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, max_len = 4, 2, 16, 32
    backend = TritonAttentionBackend(
        AttentionShape(heads, kv_heads, head_dim, 4, max_len, torch.device("cpu"), torch.float32)
    )
    q_lens, kv_lens, rows = [1, 1, 9], [5, 7, 12], [0, 1, 2]
    spans = [[], [], [(2, 10)]]  # the image starts in the cached prefix and ends before the prompt does
    batch = build_forward_batch(
        input_ids=[5] * sum(q_lens),
        req_rows=rows,
        q_lens=q_lens,
        kv_lens=kv_lens,
        out_slots=[row * max_len + p for row, q, kv in zip(rows, q_lens, kv_lens) for p in range(kv - q, kv)],
        logits_indices=[0, 1, sum(q_lens) - 1],
    )
    batch.images = ImageEmbeds(torch.empty(0, dtype=torch.int64), torch.empty(0, 8), spans)
    req_to_token = torch.arange(3 * max_len, dtype=torch.int32).view(3, max_len)
    k_cache, v_cache = torch.randn(2, 3 * max_len, kv_heads, head_dim, generator=gen).unbind(0)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen)
    backend.init_forward_metadata(batch, req_to_token)
    assert backend.metadata.num_decode_prefix == 2  # the decodes took flash-decoding
    out = backend.forward(q, k_cache, v_cache, AttentionParams(0.25, sliding_window=window))
    lengths = (batch.req_rows, batch.q_start, batch.q_lens, batch.kv_lens)
    opened = token_spans(spans, q_lens, kv_lens)
    ref = prefill_attention_ref(q, k_cache, v_cache, req_to_token, *lengths, 0.25, window, spans=opened)
    assert max_rel_error(out, ref) <= 1e-5
    causal = prefill_attention_ref(q, k_cache, v_cache, req_to_token, *lengths, 0.25, window)
    assert max_rel_error(causal, ref) > 1e-3  # the span changed the answer
