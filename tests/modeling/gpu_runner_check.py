"""GPU check (not collected by pytest): ModelRunner with the Triton backend, Triton layer ops and
decode CUDA graphs against transformers on tiny random models. Run: python3 -m tests.modeling.gpu_runner_check"""

import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from tests.modeling.helpers import max_rel_error, run_step, tiny_hf_model
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig


def check(config_cls, dtype, **overrides):
    model = tiny_hf_model(
        config_cls,
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=3,
        **overrides,
    )
    hf_config = {**model.config.to_dict(), "architectures": [type(model).__name__]}
    model = model.cuda()
    cfg = RunnerConfig(
        device="cuda", dtype=dtype, num_kv_slots=4096, max_rows=8, max_seq_len=512, cuda_graph_batch_sizes=[1, 2, 4, 8]
    )
    runner = ModelRunner.from_hf_state_dict(hf_config, model.state_dict(), cfg)
    print(type(runner.backend).__name__, runner.model.model.norm.ops.name, "graphs:", runner.cuda_graphs is not None)
    g = torch.Generator().manual_seed(0)
    lengths = (37, 64, 5)
    seqs = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]
    ref_model = model.to(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    with torch.no_grad():
        refs = [ref_model(torch.tensor([s], device="cuda")).logits[0].float() for s in seqs]
    slots = torch.randperm(4096, generator=g)[:200].tolist()
    offsets, cached = [0, 37, 101], [n - 4 for n in lengths]
    outs = [[] for _ in seqs]
    first = run_step(runner, [(i, seqs[i][:10], 0, slots[offsets[i] : offsets[i] + 10]) for i in (0, 1)])
    outs[0].append(first[0])
    outs[1].append(first[1])
    second = run_step(
        runner,
        [
            (0, seqs[0][10 : cached[0]], 10, slots[10 : cached[0]]),
            (1, seqs[1][10 : cached[1]], 10, slots[47 : 37 + cached[1]]),
            (2, seqs[2][: cached[2]], 0, slots[101 : 101 + cached[2]]),
        ],
    )
    for i in range(3):
        outs[i].append(second[i])
    for step in range(4):  # batched decode steps: these replay the CUDA graph of bucket 4
        reqs = [
            (i, [s[cached[i] + step]], cached[i] + step, [slots[offsets[i] + cached[i] + step]])
            for i, s in enumerate(seqs)
        ]
        for i, logits in enumerate(run_step(runner, reqs)):
            outs[i].append(logits.clone())
    for i in range(3):
        got = torch.cat(outs[i])
        agree = (got.argmax(-1) == refs[i].argmax(-1)).float().mean().item()
        print(
            f"{config_cls.__name__} {dtype} req {i}: rel err {max_rel_error(got, refs[i]):.2e}, argmax agree {agree:.3f}"
        )


check(LlamaConfig, "float32")
check(LlamaConfig, "bfloat16")
check(Qwen2Config, "bfloat16")
check(Qwen3Config, "float32")
check(
    LlamaConfig,
    "float32",
    rope_parameters={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 500000.0,
    },
)
