"""Triton kernels by family (docs/architecture.md §1): attention/, gemv/, quant/, moe/, comm/, elementwise/ and
sampling/; pdl.py and split_k.py are the launch helpers they share. Each kernel sits beside its PyTorch `*_ref`."""
