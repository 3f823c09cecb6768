"""LoRA adapters: PEFT folders parsed (adapter.py), their weights in per-slot device buffers beside each
projection (weights.py), a step's tokens grouped by slot (step.py) and the layer ops that add each row's
low-rank product to the base projection (layer_ops.py); manager.py ties them to a model."""
