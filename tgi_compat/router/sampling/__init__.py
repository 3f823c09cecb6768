"""Token selection, one stage (selector.py's TokenSelector): the sampler and its per-row parameters, grammar
masks and their compiles, token healing."""
