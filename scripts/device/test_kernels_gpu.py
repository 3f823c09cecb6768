"""GPU correctness on the device: the pytest `gpu` tests (tests/gpu), kernels against their references
at real shapes, then end to end. Extra arguments go to pytest (e.g. -k prefill).

Run on the device:  PYTHONPATH=$PWD python3 scripts/device/test_kernels_gpu.py
"""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    sys.exit(pytest.main(["-q", "-s", "-m", "gpu", os.path.join(ROOT, "tests", "gpu"), *sys.argv[1:]]))
