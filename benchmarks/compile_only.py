"""Triton kernels compiled for an H100 (sm_90) on a machine with no GPU.

    python -m benchmarks.compile_only [pytest args, default: tests/kernels]

The CPU tests run the kernels through Triton's interpreter, which accepts code that Triton's compiler rejects
(a jit helper returning tensors of different shapes under a constexpr branch did once). A compile-only driver
lets Triton's frontend and its NVIDIA backend build each launch's kernel down to a cubin, then stops the launch
with `Compiled`. Run as above, every kernel test runs under it: any other error is a kernel that would not
compile on the GPU (exit code 0 when every launch compiled). The kernel tests that read the compiled code
(`run_probe`, `compiled_ptx`) and benchmarks.gemv_resources use the same driver.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class Compiled(Exception):
    """A launch stopped by the compile-only driver once its kernel was built."""


def install_compile_only_driver() -> None:
    """From now on, Triton launches in this process compile for sm_90 and stop with `Compiled` (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class CompileOnlyDriver:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def launcher_cls(self, *args):
            raise Compiled("compiled for sm_90")

    driver.set_active(CompileOnlyDriver())


def compiled_kernels(kernel_fn, launch: Callable[[], object]) -> list:
    """What `launch()` compiles of the @triton.jit `kernel_fn` (compile-only driver installed)."""
    kernel_fn.device_caches.clear()
    try:
        launch()
    except Compiled:
        pass
    return [kernel for cache in kernel_fn.device_caches.values() for kernel in cache[0].values()]


def compiled_ptx(kernel_fn, launch: Callable[[], object]) -> str:
    return "\n".join(kernel.asm["ptx"] for kernel in compiled_kernels(kernel_fn, launch))


def run_probe(source: str) -> object:
    """Runs `source` (Python that installs the compile-only driver, compiles, and prints JSON on its last line) in
    a process of its own, without Triton's interpreter (which a test process may have turned on), and returns
    that JSON. Raises if the process fails."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run([sys.executable, "-c", source], cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.splitlines()[-1])


def main() -> int:
    targets = sys.argv[1:] or ["tests/kernels"]
    with tempfile.TemporaryDirectory() as folder:
        plugin = "from benchmarks.compile_only import install_compile_only_driver\n\ninstall_compile_only_driver()\n"
        (Path(folder) / "compile_only_driver.py").write_text(plugin)
        # --noconftest: tests/conftest.py would switch Triton to its interpreter
        command = [sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "compile_only_driver", *targets]
        env = {"PYTHONPATH": f"{REPO}:{folder}", "PATH": "/usr/bin:/bin"}
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    errors = [line for line in result.stdout.splitlines() if line.startswith("E   ")]
    other = [line for line in errors if "Compiled: compiled for sm_90" not in line]
    launches = len(errors) - len(other)
    print(f"{launches} test launches compiled for sm_90; {len(other)} other errors")
    for line in sorted(set(re.sub(r"0x[0-9a-f]+", "0x..", line) for line in other))[:40]:
        print(line)
    return 1 if other or launches == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
