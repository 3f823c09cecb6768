"""The few-row GEMV of decoding, with the preceding elementwise op fused in, over dense, 1-byte or int4 weights."""
