"""CPU speed check (not collected by pytest): SmolLM2 batch-1 decode step of ModelRunner vs a
transformers decode step (model forward with its KV cache, what `generate` runs per token), measured
interleaved so both see the same machine load.
Run: python tests/modeling/cpu_step_bench.py [steps] [--random-weights]"""

import glob
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, ".")
from tgi_compat.modeling.forward_batch import build_forward_batch
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig
from tgi_compat.modeling.tokenizer import cache_root

warnings.filterwarnings("ignore")

PROMPT_LEN = 32


SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def main(num_steps: int, random_weights: bool) -> None:
    cfg = RunnerConfig(device="cpu", dtype="float32", num_kv_slots=4096, max_rows=4, show_progress=False)
    if random_weights:  # same shapes as SmolLM2, for machines without the GGUF (same speed)
        from transformers import LlamaConfig, LlamaForCausalLM

        hf = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).eval()
        hf_config = {**hf.config.to_dict(), "architectures": ["LlamaForCausalLM"]}
        runner = ModelRunner.from_hf_state_dict(hf_config, hf.state_dict(), cfg)
    else:
        runner = ModelRunner(cfg)
        hf = load_hf_reference()
    ids = list(range(1000, 1000 + PROMPT_LEN))
    runner.forward(build_forward_batch(ids, [0], [PROMPT_LEN], [PROMPT_LEN], list(range(PROMPT_LEN)), [PROMPT_LEN - 1]))
    with torch.inference_mode():
        out = hf(torch.tensor([ids]), use_cache=True) if hf is not None else None
    past = out.past_key_values if out is not None else None
    ours, theirs = [], []
    for step in range(num_steps):
        pos = PROMPT_LEN + step
        start = time.perf_counter()
        batch = build_forward_batch([5], [0], [1], [pos + 1], [pos], [0])
        runner.forward(batch)
        ours.append(time.perf_counter() - start)
        if hf is not None:
            start = time.perf_counter()
            with torch.inference_mode():
                out = hf(torch.tensor([[5]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            theirs.append(time.perf_counter() - start)
    report("ModelRunner decode step (incl. batch build)", ours)
    if theirs:
        report("transformers decode forward", theirs)


def load_hf_reference():
    from transformers import AutoModelForCausalLM

    cached = glob.glob(os.path.join(cache_root(), "test-references", "smollm2-hf-*", "config.json"))
    if not cached:
        print("no cached transformers reference (run tests/modeling once); timing ours only")
        return None
    return AutoModelForCausalLM.from_pretrained(cached[0].rsplit("/", 1)[0], dtype=torch.float32).eval()


def report(name: str, times: list[float]) -> None:
    ms = sorted(t * 1e3 for t in times[5:])  # skip warm-up
    print(
        f"{name}: median {statistics.median(ms):.2f} ms, p10 {ms[len(ms) // 10]:.2f} ms, threads {torch.get_num_threads()}"
    )


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(int(args[0]) if args else 100, random_weights="--random-weights" in sys.argv)
