"""benchmarks.multiturn against the real server on the embedded model: a couple of short
conversations, outputs capped at a few tokens (bookkeeping, not speed)."""

import json
import urllib.request

from benchmarks import multiturn


def prefix_cache_hits(server_url: str) -> float:
    text = urllib.request.urlopen(f"{server_url}/metrics").read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total"))


def test_multiturn_with_the_models_own_answers_hits_the_previous_turn(server_url, tmp_path):
    hits_before = prefix_cache_hits(server_url)
    args = ["--base-url", server_url, "--workload", "multiturn", "--history", "model", "--num-conversations", "2"]
    args += ["--concurrency", "2", "--max-output-len", "4", "--max-context", "320", "--out-dir", str(tmp_path)]
    assert multiturn.main(args) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["all_turns"]["completed"] == result["config"]["num_requests"] >= 4
    follow_up_prompt_tokens = result["config"]["mean_prompt_len"] * result["config"]["num_requests"] / 2
    # Each follow-up's prompt starts with the previous turn's prompt and answer, as the server cached them.
    assert prefix_cache_hits(server_url) - hits_before >= follow_up_prompt_tokens / 2
