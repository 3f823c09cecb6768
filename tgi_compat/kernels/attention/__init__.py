"""Attention over the token-granular KV cache: flash-decoding, variable-length extend (prefill), the KV store
and rotary embedding."""
