"""Dense GEMMs with work fused into their epilogues (gated.py: a gated MLP's [gate | up] product and activation)."""
