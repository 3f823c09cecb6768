"""The small per-row ops between the projections: RMSNorm (with the residual add, Gemma's sandwich norm, q/k
norm) and the gated activations (SiLU-and-mul, GeGLU)."""
