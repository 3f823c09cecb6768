"""The residual stream after a few chosen layers, for every token of a step: what an EAGLE-3 head reads.

Opt-in (RunnerConfig.aux_hidden_layers): off, the decoder never looks at it. On, each chosen layer's output
(the residual stream after it, read where the next layer or the final norm adds it in: whole under tensor
parallelism) is copied into its column block of one [tokens, layers * hidden] buffer. The buffer is allocated
once, before the CUDA graphs are captured, so that a replayed step writes the same memory; a step larger than it
(a long eager prefill) gets a fresh one.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

# gets the residual stream entering a layer (or the final norm), whole
StreamReader = Callable[[torch.Tensor], None]


class AuxHiddenStates:
    def __init__(
        self, layers: tuple[int, ...], hidden_size: int, max_tokens: int, device: torch.device, dtype: torch.dtype
    ):
        self.layers = layers
        self.hidden_size = hidden_size
        self._static = torch.zeros(max_tokens, len(layers) * hidden_size, device=device, dtype=dtype)
        self._last = self._static
        self._step = self._static  # this step's rows of _last (start_step)

    def readers(self, num_layers: int) -> tuple[StreamReader | None, ...]:
        """Per decoder layer: what writes its output (the residual stream after it) into its column blocks of the
        step's buffer; None where it is not captured (a small model's default layers may repeat one: several
        blocks). Made once: a forward only starts its step (`start_step`)."""
        blocks = [tuple(b for b, layer in enumerate(self.layers) if layer == i) for i in range(num_layers)]
        return tuple(partial(self._write, mine) if mine else None for mine in blocks)

    def start_step(self, num_tokens: int) -> None:
        """This forward writes rows [num_tokens, layers * hidden] (called by the model as a step starts)."""
        static = self._static
        self._last = static if num_tokens <= static.shape[0] else static.new_empty(num_tokens, static.shape[1])
        self._step = self._last[:num_tokens]

    def _write(self, blocks: tuple[int, ...], stream: torch.Tensor) -> None:
        """A layer's output (the residual stream after it, summed over the ranks) into its column blocks."""
        size = self.hidden_size
        for block in blocks:
            self._step[:, block * size : (block + 1) * size].copy_(stream)

    def rows(self, num_tokens: int) -> torch.Tensor:
        """The last step's rows (eager or replayed: a graph writes the static buffer, padded rows after the real)."""
        buffer = self._static if num_tokens <= self._static.shape[0] else self._last
        return buffer[:num_tokens]


def attach_aux_hidden(model: object, layers: tuple[int, ...], max_tokens: int, dtype: torch.dtype) -> AuxHiddenStates:
    """A native decoder's forwards write the output of `layers` into the returned states from now on."""
    from tgi_compat.modeling.models.decoder import DecoderStack  # (imports the kernels: loaded with the model)

    if not isinstance(model, DecoderStack):
        raise ValueError("EAGLE-3 needs a target of a native decoder family (not the transformers fallback)")
    device = model.model.norm.weight.device
    states = AuxHiddenStates(layers, model.config.hidden_size, max_tokens, device, dtype)
    model.model.capture_aux_hidden(states)
    return states
