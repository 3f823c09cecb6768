"""TokenSelector (tgi_compat/router/sampling/selector.py): what it builds, and when."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tgi_compat.kernels.sampling import grammar_apply, grammar_confine, greedy_pick
from tgi_compat.router.sampling.sampler import SamplingKernels

UNCONSTRAINED_SERVER = """
import sys
from router_fakes import drain, hash_engine
from tgi_compat.router.request import GenerateRequest, SamplingParams

engine = hash_engine()
engine.add_request(GenerateRequest("greedy", [5, 6, 7], max_new_tokens=4))
engine.add_request(GenerateRequest("sampled", [8, 9], SamplingParams(do_sample=True, seed=1, top_n_tokens=2)))
events = drain(engine)
assert sorted(events) == ["greedy", "sampled"], events
print(engine.selector.grammar is None, engine.selector.healer is None, "xgrammar" in sys.modules)
"""


def test_a_server_that_never_constrains_never_imports_xgrammar():
    """The grammar backend and the healer are built on the first request that needs them (a fresh process:
    other tests here import xgrammar)."""
    here = Path(__file__).parent
    root = here.parent.parent  # this checkout's tgi_compat, whatever the environment installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(here)])}
    done = subprocess.run(
        [sys.executable, "-c", UNCONSTRAINED_SERVER], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "False"]


def test_kernels_are_chosen_once_for_the_device():
    on_cpu = SamplingKernels.for_device(torch.device("cpu"))
    on_gpu = SamplingKernels.for_device(torch.device("cuda"))  # a choice only: nothing runs on a GPU here
    assert (on_cpu.greedy_pick, on_cpu.grammar_apply, on_cpu.grammar_confine) == (
        greedy_pick.greedy_pick_ref,
        grammar_apply.grammar_apply_ref,
        grammar_confine.grammar_confine_ref,
    )
    assert (on_gpu.greedy_pick, on_gpu.grammar_apply, on_gpu.grammar_confine) == (
        greedy_pick.greedy_pick,
        grammar_apply.grammar_apply,
        grammar_confine.grammar_confine,
    )
