"""benchmarks.prefix_host_cost's chat replay on a few conversations."""

from benchmarks.prefix_host_cost import parse_args, run


def test_later_turns_hit_their_history_and_every_turn_runs():
    args = parse_args(["--conversations", "8", "--turns", "32", "--turns-per-conversation", "4"])
    on, off = run(args, prefix_caching=True), run(args, prefix_caching=False)
    assert on.turns == off.turns == 32
    assert off.cached_tokens == 0
    # 24 of 32 turns are follow-ups, each with all but its answer's last token and its new text cached
    assert on.cached_tokens > 0.6 * on.prompt_tokens
    assert on.seconds["hit table"] > 0 and "hit table" not in off.seconds
