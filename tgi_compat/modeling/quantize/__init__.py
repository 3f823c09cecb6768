"""Offline quantization (`python -m tgi_compat.quantize`): read a checkpoint, quantize its Linear
weights, write a compressed-tensors checkpoint that tgi_compat.modeling.layers.quantization (and vLLM) loads."""
