"""Thin FastAPI route functions, one module per API family."""
