"""The one hand-scripted EngineClient of the unit tests (like vLLM's scheduler tests with a hand-made
runner output): every request gets the same continuation ids, then EOS; health checks answer as
scripted. API tests (tests/api, tests/openai) drive the real app over it, ops tests the health monitor."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from tgi_compat.api.config import ServerConfig
from tgi_compat.api.serving.state import AppState
from tgi_compat.api.serving.tokenization import TokenizerService
from tgi_compat.router.client_api import EngineClient, EngineDeadError, EngineInfo, RequestRejectedError
from tgi_compat.router.outputs import TokenEvent, TopToken
from tgi_compat.router.request import GenerateRequest

EOS_ID = 2


class ScriptedEngine(EngineClient):
    """Answers every request with the same continuation ids, then EOS; honours max_new_tokens
    (length before EOS, like TGI), reports logprobs/top tokens/prompt logprobs when asked."""

    def __init__(
        self,
        continuation: Sequence[int] = (),
        max_total_tokens: int = 64,
        delay: float = 0.0,
        health: Sequence[str] = ("ok",),
        can_restart: bool = False,
        restart_ok: bool = True,
    ) -> None:
        self.continuation = list(continuation)
        self.delay = delay
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.closed: list[str] = []
        # check_health's answers in turn, the last one repeated: "ok", "fail", "hang" or "dead" (raises)
        self.health = list(health)
        self.num_health_checks = 0
        self.alive = True  # is_dead's answer
        self.can_restart = can_restart
        self.restart_ok = restart_ok  # whether restart() brings it back
        self.num_restarts = 0
        self.fail_with: str | None = None
        self.refuse_with: RequestRejectedError | None = None  # what the engine's own validation raises
        self.num_cached_tokens = 0  # reported with the first event, as the engine's prefix cache does
        self.info = EngineInfo(
            model_id="scripted",
            architecture="LlamaForCausalLM",
            dtype="float32",
            device="cpu",
            vocab_size=49152,
            max_position_embeddings=8192,
            num_kv_slots=4096,
            max_total_tokens=max_total_tokens,
            eos_token_ids=(EOS_ID,),
        )

    def _events(self, request: GenerateRequest) -> list[TokenEvent]:
        ids = [*self.continuation, EOS_ID]
        events = []
        for step, token_id in enumerate(ids, start=1):
            finish = "length" if step == request.max_new_tokens else ("eos_token" if token_id == EOS_ID else None)
            top = []
            if request.sampling.top_n_tokens:
                top = [[TopToken(token_id, -0.5), TopToken(token_id + 1, -1.5)][: request.sampling.top_n_tokens]]
            event = TokenEvent(
                request.request_id,
                [token_id],
                [-0.5 - 0.01 * step],
                top,
                finish_reason=finish,
                seed=request.sampling.seed,
                num_prompt_tokens=len(request.prompt_ids),
            )
            if step == 1:
                event.num_cached_tokens = self.num_cached_tokens
            if step == 1 and request.prompt_logprobs:
                event.prompt_logprobs = [None] + [-1.0] * (len(request.prompt_ids) - 1)
                if request.sampling.top_n_tokens:  # the engine's order: likeliest first (an id past the prompt's)
                    alternatives = [
                        [TopToken(t + 1, -0.25), TopToken(t, -1.0)][: request.sampling.top_n_tokens]
                        for t in request.prompt_ids[1:]
                    ]
                    event.prompt_top_tokens = [[], *alternatives]
            events.append(event)
            if finish:
                break
        return events

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        self.requests.append(request)
        if self.refuse_with is not None:
            raise self.refuse_with
        try:
            if self.fail_with is not None:
                yield TokenEvent(request.request_id, finish_reason="error", error=self.fail_with)
                return
            for event in self._events(request):
                await asyncio.sleep(self.delay)
                yield event
        finally:
            self.closed.append(request.request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    @property
    def healthy(self) -> bool:
        return self.health[-1] == "ok"

    @healthy.setter
    def healthy(self, value: bool) -> None:
        self.health = ["ok" if value else "fail"]

    @property
    def is_dead(self) -> bool:
        return not self.alive

    async def check_health(self) -> bool:
        self.num_health_checks += 1
        answer = self.health.pop(0) if len(self.health) > 1 else self.health[0]
        if answer == "hang":
            await asyncio.sleep(10)
        if answer == "dead":
            raise EngineDeadError("gone")
        return answer == "ok"

    async def restart(self) -> None:
        self.num_restarts += 1
        if not self.restart_ok:
            raise RuntimeError("model failed to load")
        self.alive = True
        self.health = ["ok"]

    async def shutdown(self) -> None:
        pass


def make_state(engine: ScriptedEngine, tokenizer: TokenizerService, **overrides) -> AppState:
    config = replace(ServerConfig(model_id="HuggingFaceTB/SmolLM2-135M-Instruct"), **overrides)
    return AppState.over_engine(config, engine, tokenizer)
