"""The soak: the real server fuzzed from TGI's OpenAPI document, then a burst of streams (`python -m
benchmarks.soak`; its __main__ says what passes). Reliability, not speed: not in CI, run by hand."""
