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


def test_multiturn_with_reference_answers_sends_the_same_prompts_and_hits_the_previous_prompt(server_url, tmp_path):
    """`--history reference` (the prefix_side_by_side.sh row every server gets identical prompts for):
    turn k+1's prompt extends turn k's, so the cache serves at least most of the previous prompt."""
    from benchmarks.tokenizer import load_tokenizer

    hits_before = prefix_cache_hits(server_url)
    args = ["--base-url", server_url, "--workload", "multiturn", "--history", "reference", "--num-conversations", "2"]
    args += ["--concurrency", "2", "--max-output-len", "4", "--max-context", "320", "--out-dir", str(tmp_path)]
    assert multiturn.main(args) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    conversations = multiturn.multiturn_workload(load_tokenizer(None), 2, 320, 4, seed=0)
    turns = [turn for conversation in conversations for turn in conversation]
    assert result["all_turns"]["completed"] == result["config"]["num_requests"] == len(turns) >= 4
    previous_prompts = 0
    for conversation in conversations:
        for before, after in zip(conversation, conversation[1:]):
            assert after.request.prompt.startswith(before.request.prompt)
            previous_prompts += before.request.prompt_len
    assert prefix_cache_hits(server_url) - hits_before >= previous_prompts / 2


def test_min_turns_keeps_only_conversations_that_long():
    from benchmarks.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    conversations = multiturn.multiturn_workload(tokenizer, 3, 1024, 4, seed=0, min_turns=4)
    assert len(conversations) == 3 and min(len(c) for c in conversations) >= 4


def test_the_servers_ttft_breakdown_covers_the_run(server_url, tmp_path):
    """Means over the run's requests from /metrics: tokenizing and waiting both come before the first token."""
    args = ["--base-url", server_url, "--workload", "shared-prefix", "--num-prompts", "4", "--system-len", "64"]
    args += ["--question-len", "8", "--output-len", "2", "--concurrency", "2", "--out-dir", str(tmp_path)]
    assert multiturn.main(args) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    server = result["server_mean_ms"]
    assert set(server) == {"validation_mean_ms", "queue_mean_ms", "ttft_mean_ms"}
    assert 0 <= server["validation_mean_ms"] <= server["ttft_mean_ms"]
    assert 0 < server["queue_mean_ms"] <= server["ttft_mean_ms"]
    assert multiturn.server_breakdown(None, None) == {}
    # 4 prompts of one 64-token system prompt, 2 at a time: the later ones find it cached
    assert 0.2 < result["server_prefix_hit_share"] < 1
    assert multiturn.prefix_hit_share(None, None) is None
