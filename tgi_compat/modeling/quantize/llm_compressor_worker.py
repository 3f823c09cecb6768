"""AWQ / GPTQ through llm-compressor, run by the quantization tool in llm-compressor's own environment.

    python llm_compressor_worker.py JOB_JSON

llm-compressor pins transformers and compressed-tensors to versions other than ours, so this file imports
nothing from tgi_compat: the tool (tgi_compat.modeling.quantize.llm_compressor) writes the model as a plain
transformers checkpoint and the calibration token ids, starts this script with that environment's Python, and
reads back the compressed-tensors `pack-quantized` checkpoint it saves. JOB_JSON's keys: model (folder), output
(folder), method ("awq" or "gptq"), group_size, samples (a JSON file: a list of token-id lists).
"""

from __future__ import annotations

import json
import sys


def main(job_path: str) -> None:
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.pipelines.cache import IntermediatesCache
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not torch.cuda.is_available():  # AWQ pins its cached activations for GPU copies: a CPU-only torch refuses
        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None

    with open(job_path) as f:
        job = json.load(f)
    with open(job["samples"]) as f:
        samples: list[list[int]] = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32, use_kernels=False)
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    # int4 groups, symmetric: what the server's int4 kernels read from a pack-quantized checkpoint
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=job["group_size"])
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    modifier = AWQModifier if job["method"] == "awq" else GPTQModifier
    recipe = modifier(config_groups=groups, ignore=["lm_head"])
    dataset = Dataset.from_dict({"input_ids": samples, "attention_mask": [[1] * len(s) for s in samples]})
    oneshot(
        model=model,
        dataset=dataset,
        recipe=recipe,
        max_seq_length=max(len(s) for s in samples),
        num_calibration_samples=len(samples),
    )
    model.to(getattr(torch, job["dtype"])).save_pretrained(job["output"], save_compressed=True)
    tokenizer.save_pretrained(job["output"])


if __name__ == "__main__":
    main(sys.argv[1])
