"""Benchmarks that need a GPU (not CI). Each module is an entry point, `python3 -m benchmarks.device.NAME`
from the repo root on the device machine (PYTHONPATH=$PWD:/tmp/site there), and writes its JSON under $OUT;
the .sh files drive a server over HTTP. benchmarks/README.md lists them all with what each measures.
"""
