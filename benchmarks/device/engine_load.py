"""Load driven straight into an engine process through the server's own client (ZmqEngineClient), no HTTP:
what the engine alone delivers, as the overlap, grammar and tensor-parallel benchmarks measure it."""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field

from tgi_compat.router.client import ZmqEngineClient
from tgi_compat.router.request import GenerateRequest

_ids = itertools.count()


def random_prompts(rng: random.Random, count: int, length: int, top: int = 100_000) -> list[list[int]]:
    """Random ids from 1,000 up: no special tokens, and no two prompts share a prefix a cache could serve."""
    return [[rng.randrange(1000, top) for _ in range(length)] for _ in range(count)]


def request(prompt: list[int], new_tokens: int, **fields) -> GenerateRequest:
    """`new_tokens` generated whatever the model says (ignore_eos), under an id no other request had."""
    return GenerateRequest(f"bench-{next(_ids)}", prompt, max_new_tokens=new_tokens, ignore_eos=True, **fields)


@dataclass
class Stream:
    """One request as its client saw it: when it was sent, and when each batch of its token events arrived."""

    sent: float
    arrivals: list[float] = field(default_factory=list)  # perf_counter of each batch
    events: list[int] = field(default_factory=list)  # token events in each batch (more than one: a catch-up)
    tokens: int = 0

    def event_times(self) -> list[float]:
        return [t for t, count in zip(self.arrivals, self.events) for _ in range(count)]

    def ms_per_token(self) -> float:
        """(last arrival - first) / (tokens - 1): the time per output token after the first."""
        return 1e3 * (self.arrivals[-1] - self.arrivals[0]) / max(self.tokens - 1, 1)


async def stream(client: ZmqEngineClient, req: GenerateRequest) -> Stream:
    """Runs the request to its end; an engine error ends the run."""
    result = Stream(time.perf_counter())
    async for batch in client.generate_batches(req):
        result.arrivals.append(time.perf_counter())
        result.events.append(len(batch))
        result.tokens += sum(len(event.token_ids) for event in batch)
        if batch[-1].error:
            raise RuntimeError(batch[-1].error)
    return result
