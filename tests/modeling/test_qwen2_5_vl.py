"""Qwen2.5-VL with images, natively: transformers' vision tower's rows scattered at the `<|image_pad|>`
placeholders, M-RoPE (t/h/w) positions in our rotary path for prefill and decode (the rope delta past the prompt);
logits and greedy text against transformers' own Qwen2_5_VLForConditionalGeneration on the same weights (fp32),
with one image and with two of different sizes (dynamic resolution); the logits and greedy text of Qwen2-VL (the
same model with its own vision tower) against transformers' Qwen2VLForConditionalGeneration too."""

from __future__ import annotations

import pytest
import torch

from tests.modeling.helpers import max_rel_error, runner_for_folder
from tests.modeling.qwen2_5_vl_helpers import (
    FAMILIES,
    image_processor,
    picture,
    reference_greedy,
    reference_logits,
    saved_qwen2_5_vl,
)
from tgi_compat.modeling.forward_batch import ImageEmbeds, build_forward_batch
from tgi_compat.modeling.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from tgi_compat.router.images import PromptImage
from tgi_compat.router.mrope import MropePrompt, prompt_mrope

VOCAB = 300
START, END, IMAGE = VOCAB - 3, VOCAB - 2, VOCAB - 1
SIZES = [(84, 56), (50, 90)]  # (width, height): 3x2 and 2x3 placeholders (dynamic resolution)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """family -> (transformers' model, our runner on its checkpoint), each built once for the module's tests."""
    built = {}

    def pair_of(family: str):
        if family not in built:
            folder = tmp_path_factory.mktemp(family)
            model = saved_qwen2_5_vl(folder, VOCAB, family)
            runner = runner_for_folder(str(folder))
            assert isinstance(runner.model, Qwen2_5_VLForConditionalGeneration)
            built[family] = model, runner
        return built[family]

    return pair_of


@pytest.fixture(scope="module")
def pair(pairs):
    return pairs("qwen2_5_vl")


@pytest.fixture(params=FAMILIES)
def family_pair(pairs, request):
    return pairs(request.param)


def processed(num_images: int):
    colors = [(200, 30, 60), (10, 220, 90)]
    pictures = [picture(colors[i], SIZES[i]) for i in range(num_images)]
    return image_processor()(images=pictures, return_tensors="pt")


def grids(inputs) -> list[tuple[int, int]]:
    return [(int(h) // 2, int(w) // 2) for _, h, w in inputs["image_grid_thw"].tolist()]


def prompt(grid: list[tuple[int, int]], *texts: list[int]) -> tuple[list[int], list[PromptImage]]:
    """Text runs joined by images, as TGI's prompt for Qwen2.5-VL puts them, and the engine's PromptImages."""
    ids, images = list(texts[0]), []
    for (rows, columns), text in zip(grid, texts[1:]):
        ids.append(START)
        images.append(PromptImage(len(ids), rows * columns, f"{len(images):064x}", b"", grid=(rows, columns)))
        ids += [IMAGE] * (rows * columns) + [END] + text
    return ids, images


def text(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB - 10, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(runner, ids, start, slots, features, mrope: MropePrompt) -> torch.Tensor:
    """One step of the new tokens ids[start:] over the cached ids[:start]; logits of every new token."""
    new = len(ids) - start
    batch = build_forward_batch(ids[start:], [0], [new], [len(ids)], slots[start : len(ids)], list(range(new)))
    rows = [p - start for p in range(start, len(ids)) if ids[p] == IMAGE]
    if rows:
        first = sum(1 for p in range(start) if ids[p] == IMAGE)
        taken = torch.cat(features)[first : first + len(rows)]
        batch.images = ImageEmbeds(torch.tensor(rows), taken, [[]])
    batch.rope_positions = torch.tensor(mrope.rows(start, len(ids)))
    return runner.forward(batch)


@pytest.mark.parametrize("texts", [(3, 4, 2), (0, 4, 0), (1, 0, 1)], ids=["between", "at-both-ends", "adjacent"])
def test_mrope_positions_equal_transformers_rope_index(pair, texts):
    """Text around, before and after two images of different grids; images first and last; images back to back."""
    model, _ = pair
    inputs = processed(2)
    ids, images = prompt(grids(inputs), *(text(seed, n) for seed, n in enumerate(texts)))
    input_ids = torch.tensor([ids])
    expected, delta = model.model.get_rope_index(
        input_ids, (input_ids == IMAGE).int(), image_grid_thw=inputs["image_grid_thw"]
    )
    mrope = prompt_mrope(len(ids), images)
    assert mrope is not None
    assert torch.tensor(mrope.positions).tolist() == expected[:, 0].tolist()
    assert mrope.delta == int(delta)


@pytest.mark.parametrize("num_images", [1, 2])
def test_logits_with_images_equal_transformers(family_pair, num_images):
    model, runner = family_pair
    inputs = processed(num_images)
    ids, images = prompt(grids(inputs), text(1, 5), *(text(2 + i, 6) for i in range(num_images)))
    mrope = prompt_mrope(len(ids), images)
    assert mrope is not None and mrope.delta < 0  # an image's tokens take fewer positions than tokens
    ref = reference_logits(model, ids, inputs)
    features = runner.model.encode_processed(dict(inputs))
    assert [f.shape[0] for f in features] == [image.length for image in images]
    slots = list(range(100, 100 + len(ids)))
    ours = run(runner, ids, 0, slots, features, mrope)
    assert max_rel_error(ours, ref) <= 1e-3
    # chunked prefill: the first chunk ends inside the last image, the rest runs over the cached prefix
    cut = images[-1].offset + 1
    first = run(runner, ids[:cut], 0, slots, features, mrope)
    rest = run(runner, ids, cut, slots, features, mrope)
    assert max_rel_error(torch.cat([first, rest]), ref) <= 1e-3


def test_the_image_changes_the_logits(pair):
    _, runner = pair
    inputs = processed(1)
    ids, images = prompt(grids(inputs), text(1, 5), text(2, 6))
    mrope = prompt_mrope(len(ids), images)
    assert mrope is not None
    slots = list(range(len(ids)))
    red = run(runner, ids, 0, slots, runner.model.encode_processed(dict(inputs)), mrope)
    other = image_processor()(images=[picture((10, 220, 90), SIZES[0])], return_tensors="pt")
    green = run(runner, ids, 0, slots, runner.model.encode_processed(dict(other)), mrope)
    assert (red[-1] - green[-1]).abs().max() > 1e-2


def test_greedy_text_equals_transformers_generate(family_pair):
    """Decode steps rotate by position + the rope delta: a wrong delta changes the greedy text."""
    model, runner = family_pair
    inputs = processed(2)
    ids, images = prompt(grids(inputs), text(7, 4), text(8, 3), text(9, 5))
    expected = reference_greedy(model, ids, inputs, 12)
    mrope = prompt_mrope(len(ids), images)
    assert mrope is not None
    slots = list(range(200, 200 + len(ids) + 12))
    features = runner.model.encode_processed(dict(inputs))
    steps = [run(runner, ids, 0, slots, features, mrope)[-1]]
    out = [int(steps[-1].argmax())]
    while len(out) < len(expected):
        seq = ids + out
        steps.append(run(runner, seq, len(seq) - 1, slots, features, mrope)[-1])
        out.append(int(steps[-1].argmax()))
    assert out == expected
    # every decode step's logits too (transformers' whole-sequence forward numbers text after the prompt on)
    ref = reference_logits(model, ids + out[:-1], inputs)[len(ids) - 1 :]
    assert max_rel_error(torch.stack(steps), ref) <= 1e-3


class _Replayed:
    """A stand-in for a captured CUDA graph on the CPU: replay runs the step over the graphs' static inputs, which
    is what the captured kernels read, so the input plumbing (the static rope rows, their copy and padding) is
    what this checks."""

    def __init__(self, graphs, size: int):
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        self.graphs.outputs[self.size, False] = self.graphs.graph_step(self.size, with_lora=False)()


def test_decode_graph_inputs_carry_the_rope_rows(pair):
    """Decode steps through DecodeCudaGraphs' replay (M-RoPE: a static [3, N] buffer filled from the step's rows,
    padded past the batch: two requests in the bucket of 4) give transformers' logits: a request with images beside
    a text-only one."""
    from tgi_compat.modeling.cuda_graphs import DecodeCudaGraphs

    model, runner = pair
    graphs = DecodeCudaGraphs(
        runner._forward_eager, [1, 4], runner.max_rows, runner.num_kv_slots, runner.max_seq_len, "cpu", mrope=True
    )
    graphs.graphs = {(size, False): _Replayed(graphs, size) for size in graphs.batch_sizes}
    inputs = processed(1)
    ids, images = prompt(grids(inputs), text(1, 4), text(2, 3))
    mrope = prompt_mrope(len(ids), images)
    assert mrope is not None
    plain = text(5, 6)
    full, plain_full = ids + text(3, 3), plain + text(4, 3)
    slots, plain_slots = list(range(300, 300 + len(full))), list(range(400, 400 + len(plain_full)))
    features = runner.model.encode_processed(dict(inputs))
    run(runner, ids, 0, slots, features, mrope)  # the prefills, eager
    prefill = build_forward_batch(plain, [1], [len(plain)], [len(plain)], plain_slots[: len(plain)], [0])
    runner.forward(prefill)
    steps = []
    for p, q in zip(range(len(ids), len(full)), range(len(plain), len(plain_full))):
        batch = build_forward_batch([full[p], plain_full[q]], [0, 1], [1, 1], [p + 1, q + 1], [slots[p], plain_slots[q]], [0, 1])  # fmt: skip
        t, h, w = mrope.rows(p, p + 1)
        batch.rope_positions = torch.tensor([t + [q], h + [q], w + [q]])
        assert graphs.can_run(batch)
        steps.append(graphs.replay(batch).clone())
    ours = torch.stack(steps)
    ref = reference_logits(model, full, inputs)[len(ids) :]
    plain_ref = model(input_ids=torch.tensor([plain_full])).logits[0, len(plain) :].float().detach()
    assert max_rel_error(ours[:, 0], ref) <= 1e-3
    assert max_rel_error(ours[:, 1], plain_ref) <= 1e-3
