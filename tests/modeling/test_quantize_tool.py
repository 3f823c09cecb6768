"""`python -m tgi_compat.quantize` on the embedded SmolLM2 GGUF: each -quant_type writes a
compressed-tensors checkpoint that the runner loads and that keeps the model's greedy text, its
logits and its perplexity close to the unquantized model's; and the tool's flag errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.modeling.helpers import full_logits, runner_for_folder, smollm2_gguf_path
from tgi_compat.modeling.quantize.compressed_tensors_writer import (
    LINEAR_WEIGHT,
    int4_tensors,
    quantization_config,
    write_checkpoint,
)
from tgi_compat.quantize import main

TEXT = (
    "The city of Paris is the capital of France. It is known for the Eiffel Tower, the Louvre museum and its "
    "cafes. Every year millions of tourists visit the city to see its monuments and to enjoy French food."
)


def perplexity(runner, ids: list[int]) -> float:
    logits = full_logits(runner, ids)[:-1]
    return torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).exp().item()


@pytest.fixture(scope="module")
def reference(smollm2_runner, smollm2_tokenizer):
    ids = smollm2_tokenizer(TEXT).input_ids
    return ids, full_logits(smollm2_runner, ids), perplexity(smollm2_runner, ids)


def _quantized(tmp_path_factory, *argv: str):
    out = str(tmp_path_factory.mktemp("quantized"))
    assert main(["-i", smollm2_gguf_path(), "-o", out, "-t", "bf16", *argv]) == 0
    return out, runner_for_folder(out)


@pytest.mark.parametrize(
    "argv, scheme, ppl_bound, logit_bound",
    [
        pytest.param(  # measured ppl -2.3%, logits 0.043; in the smoke set of `make test-latest`
            ["-quant_type", "weight_only_int8"], "int8", 1.02, 0.06, marks=pytest.mark.latest_deps
        ),
        (["-quant_type", "smooth_quant", "-sq", "0.8"], "int8", 1.02, 0.2),  # measured ppl +1.5%, logits 0.141
    ],
)
def test_tool_checkpoint_serves_close_to_the_original(
    tmp_path_factory, tmp_path, reference, smollm2_tokenizer, argv, scheme, ppl_bound, logit_bound
):
    if "smooth_quant" in argv:  # a small calibration set from a token-id file keeps the test short
        calibration = tmp_path / "tokens.txt"
        lines = [smollm2_tokenizer(t).input_ids for t in (TEXT, "def add(a, b):\n    return a + b", "Once upon a time")]
        calibration.write_text("\n".join(" ".join(map(str, ids)) for ids in lines))
        argv = [*argv, "-token", str(calibration)]
    out, runner = _quantized(tmp_path_factory, *argv)
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert runner.model.model.layers[0].self_attn.qkv_proj.method.name == scheme
    assert runner.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.int8
    ids, ref_logits, ref_ppl = reference
    logits = full_logits(runner, ids)
    rel = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
    ppl = perplexity(runner, ids)
    print(f"{argv[1]}: max logit error {rel:.3f} of the largest logit, perplexity {ppl:.3f} vs {ref_ppl:.3f}")
    assert rel < logit_bound and ppl < ref_ppl * ppl_bound
    # greedy continuation of the first sentence: the unquantized model's next tokens
    prompt = smollm2_tokenizer("The city of Paris is the capital of").input_ids
    assert full_logits(runner, prompt)[-1].argmax().item() == ref_logits[len(prompt) - 1].argmax().item()


def test_int4_pack_quantized_checkpoint_loads_and_stays_close(tmp_path, reference, smollm2_runner):
    """The compressed-tensors int4 format (what llm-compressor's AWQ/GPTQ write) through the real loader."""
    from tgi_compat.modeling.quantize.tool import hf_config_dict
    from tgi_compat.modeling.source import resolve_model_source
    from tgi_compat.modeling.weights.loader import iterate_weights, load_model_config

    source = resolve_model_source(smollm2_gguf_path())
    config = load_model_config(source)
    tensors = {}
    for name, tensor in iterate_weights(source, config, show_progress=False):
        tensors.update(int4_tensors(name, tensor, torch.bfloat16, 64) if LINEAR_WEIGHT.search(name) else {name: tensor})
    write_checkpoint(str(tmp_path), hf_config_dict(source, config, "bf16"), tensors, quantization_config("w4a16", 64))
    runner = runner_for_folder(str(tmp_path))
    assert runner.model.model.layers[0].mlp.down_proj.method.name == "int4"
    ids, _, ref_ppl = reference
    ppl = perplexity(runner, ids)
    print(f"int4 (round to nearest, groups of 64): perplexity {ppl:.3f} vs {ref_ppl:.3f}")
    assert ppl < ref_ppl * 1.5  # no calibration: only that the packing is read right (garbage is >> 10x)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-i", "/nonexistent/model", "-o", "{tmp}/out", "-quant_type", "weight_only_int8"], "does not exist"),
        (["-i", "{gguf}", "-o", "{tmp}/out", "-quant_type", "int3"], "-quant_type int3 is not one of"),
        (["-i", "{gguf}", "-o", "{tmp}/out", "-quant_type", "weight_only_int8", "-t", "fp32"], "-t fp32 is not one of"),
        (["-i", "{gguf}", "-o", "/proc/quantized", "-quant_type", "weight_only_int8"], "is not writable"),
        (["-i", "{gguf}", "-o", "{tmp}/out", "-quant_type", "awq"], "needs llm-compressor"),
        (["-i", "{gguf}", "-o", "{tmp}/out", "-quant_type", "smooth_quant", "-sq", "1.5"], "must be within"),
        (["-i", "{gguf}", "-o", "{tmp}/out", "-quant_type", "smooth_quant", "-token", "{tmp}/none"], "no such file"),
    ],
)
def test_tool_errors(tmp_path, capsys, argv, message):
    argv = [a.format(tmp=tmp_path, gguf=smollm2_gguf_path()) for a in argv]
    assert main(argv) == 1
    assert message in capsys.readouterr().err


def test_tool_requires_its_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["-i", "x"])
    assert exit_info.value.code == 2 and "-quant_type" in capsys.readouterr().err
