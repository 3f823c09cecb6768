"""`--load-format dummy` (vLLM's flag): random weights for a folder that holds only config.json and a
tokenizer, so that a model of any size can be served and measured without a checkpoint on disk.

The tensors are the ones a real safetensors checkpoint of the architecture holds, by name and shape:
transformers builds the model on the meta device (no memory), and its state dict goes through what
`save_pretrained` does to it (tied weights dropped, v5 weight conversions reverted). Each tensor is
a `DummyTensor`: a tensor-parallel rank that narrows it creates only its slice, on its own device.

Values: normal(0, 0.02) for matrices, ones for 1-D weights (norms), zeros for biases. Each slice is
seeded from its name and range, so runs are reproducible and ranks that hold the same slice (KV heads
replicated over ranks, an MoE router) hold the same values.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

INIT_STD = 0.02


class DummyTensor:
    """A checkpoint tensor that does not exist yet: made (random) when a loader takes it or a slice of it."""

    def __init__(self, name: str, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> None:
        self.name, self.shape, self._device, self._dtype = name, shape, device, dtype

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        shape = tuple(length if d == dim else size for d, size in enumerate(self.shape))
        return self._make(shape, f"{dim}:{start}:{length}")

    def materialize(self) -> torch.Tensor:
        return self._make(self.shape, "all")

    def _make(self, shape: tuple[int, ...], part: str) -> torch.Tensor:
        if len(self.shape) <= 1:
            fill = 0.0 if self.name.endswith("bias") else 1.0
            return torch.full(shape, fill, dtype=self._dtype, device=self._device)
        generator = torch.Generator(device=self._device)
        generator.manual_seed(zlib.crc32(f"{self.name}|{part}".encode()))
        return torch.empty(shape, dtype=self._dtype, device=self._device).normal_(0.0, INIT_STD, generator=generator)


def checkpoint_shapes(folder: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a safetensors checkpoint of the model in `folder` holds."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(folder)
    # The named architecture (a multimodal checkpoint's own class, not just its text model), else the auto class
    architecture = getattr(transformers, (hf_config.architectures or [""])[0], None)
    with torch.device("meta"):
        if architecture is not None:
            model = architecture(hf_config)
        else:
            model = AutoModelForCausalLM.from_config(hf_config)
    return {name: tuple(tensor.shape) for name, tensor in _saved_state_dict(model).items()}


def _saved_state_dict(model) -> dict[str, torch.Tensor]:
    """The state dict under the names and shapes save_pretrained writes."""
    state = model.state_dict()
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict, revert_weight_conversion
    except ImportError:  # transformers 4: no weight conversions; a tied alias is a repeated Parameter
        aliases = set(dict(model.named_parameters(remove_duplicate=False))) - set(dict(model.named_parameters()))
        return {name: tensor for name, tensor in state.items() if name not in aliases}
    return revert_weight_conversion(model, remove_tied_weights_from_state_dict(state, model))


def iterate_dummy_weights(
    folder: str, device: torch.device, dtype: torch.dtype, lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor | DummyTensor]]:
    """(checkpoint name, DummyTensor) pairs; lazy False: the tensors themselves, made one at a time."""
    for name, shape in checkpoint_shapes(folder).items():
        tensor = DummyTensor(name, shape, device, dtype)
        yield name, tensor if lazy else tensor.materialize()
