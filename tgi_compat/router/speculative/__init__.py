"""Speculative decoding: draft tokens proposed without a draft model, verified in the normal step.

    proposers (ngram.py, suffix.py) -> draft-length policy (policy.py) -> verify rows in the step batch

A proposer sees one request's tokens (prompt + generated) and proposes the tokens that likely follow;
the policy picks how many to verify from the batch size and each request's acceptance so far (before its own
drafts: the server-wide estimate of estimate.py, which also decides when to draft anyway to find out).
"""
