"""Triton kernels compiled for an H100 (sm_90) on a machine with no GPU.

    python -m benchmarks.compile_only [pytest args, default: tests/kernels]

The CPU tests run the kernels through Triton's interpreter, which accepts code that Triton's compiler rejects
(a jit helper returning tensors of different shapes under a constexpr branch did once). A compile-only driver
lets Triton's frontend and its NVIDIA backend build each launch's kernel down to a cubin, then stops the launch
with `Compiled`. Run as above, every kernel test runs under it: any other error is a kernel that would not
compile on the GPU (exit code 0 when every launch compiled). The kernel tests that read the compiled code
(`run_probe`, `compiled_ptx`) and benchmarks.gemv_resources use the same driver.

    python -m benchmarks.compile_only --dump DIR [--pdl] [--repo CHECKOUT] [pytest args]
    python -m benchmarks.compile_only --compare DIR_A DIR_B

--dump writes the PTX of every kernel the tests compile into DIR (of CHECKOUT, default this one): launches do
nothing instead of stopping, so a test goes on to its later launches until an assertion meets the unwritten
outputs. --pdl launches the decode-step kernels as programmatic dependents, as on Hopper (CPU tensors never ask
for it). --compare matches two dumps' kernels modulo names and line info: a refactor that leaves the generated
code alone (a jit body split into helpers, a module moved) reports every kernel identical.
"""

from __future__ import annotations

import argparse
import itertools
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


PLUGIN = "from benchmarks.compile_only import install_compile_only_driver\n\ninstall_compile_only_driver()\n"


DUMP_PLUGIN = """
import json
import os
from pathlib import Path

from triton.compiler import compiler

_OUT = Path(os.environ["KERNEL_ASM_DUMP"])


def _record_and_skip(self):
    # replaces CompiledKernel._init_handles: the kernel is compiled, so write its PTX and launch nothing
    if self.module is not None:
        return
    number = sum(1 for _ in _OUT.glob("*.ptx"))
    file = f"{number:05d}-{self.name}.ptx"
    (_OUT / file).write_text(self.asm["ptx"])
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    with open(_OUT / "index.jsonl", "a") as index:
        index.write(json.dumps({"file": file, "kernel": self.name, "test": test}) + "\\n")
    self.module = "compile-only"
    self._run = lambda *args: None


compiler.CompiledKernel._init_handles = _record_and_skip

if os.environ.get("KERNEL_DUMP_PDL") == "1":  # before any kernel module binds these
    from tgi_compat.kernels import pdl

    pdl.use_pdl = lambda tensor: True
    pdl.use_pdl_for_one_request = lambda tensor, num_requests: num_requests == 1
"""


def _run_tests(repo: Path, plugin: str, targets: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "compile_only_driver.py").write_text(plugin)
        # --noconftest: tests/conftest.py would switch Triton to its interpreter
        command = [sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "compile_only_driver", *targets]
        env = {"PYTHONPATH": f"{repo}:{folder}", "PATH": "/usr/bin:/bin", **env}
        return subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)


def dump(out: Path, repo: Path, targets: list[str], pdl: bool) -> int:
    out.mkdir(parents=True, exist_ok=False)
    env = {"KERNEL_ASM_DUMP": str(out.resolve()), "KERNEL_DUMP_PDL": "1" if pdl else "0"}
    result = _run_tests(repo, PLUGIN + DUMP_PLUGIN, targets, env)
    print(result.stdout.splitlines()[-1] if result.stdout else result.stderr[-3000:])
    print(f"{sum(1 for _ in out.glob('*.ptx'))} kernels compiled for sm_90 into {out}")
    return 0


def normalized_ptx(ptx: str, name: str) -> str:
    """PTX without its debug sections, line info and comments, the kernel's name replaced."""
    ptx = ptx.split("\t.section\t.debug", 1)[0]
    lines = []
    for line in ptx.splitlines():
        line = line.split("//", 1)[0].rstrip()
        if line and not re.match(r"\s*(\.loc|\.file)\b|\$L__(tmp|func_begin|func_end)\d+:", line):
            lines.append(line.replace(name, "KERNEL"))
    return "\n".join(lines)


def compare(first: Path, second: Path) -> int:
    """Matches the kernels of two dumps by name and test, in compile order; counts the identical ones."""
    import collections
    import json

    def kernels(folder: Path) -> dict[tuple[str, str], list[str]]:
        found = collections.defaultdict(list)
        for line in (folder / "index.jsonl").read_text().splitlines():
            entry = json.loads(line)
            ptx = normalized_ptx((folder / entry["file"]).read_text(), entry["kernel"])
            found[(entry["kernel"], entry["test"])].append(ptx)
        return found

    a, b = kernels(first), kernels(second)
    same = differ = 0
    for key in sorted(a.keys() | b.keys()):
        for ptx_a, ptx_b in itertools.zip_longest(a.get(key, []), b.get(key, [])):
            if ptx_a == ptx_b:
                same += 1
            else:
                differ += 1
                print(f"differs: {key[0]} ({key[1]})" if ptx_a and ptx_b else f"only in one dump: {key}")
    print(f"{same} kernels identical, {differ} different")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump", type=Path, metavar="DIR")
    parser.add_argument("--pdl", action="store_true")
    parser.add_argument("--repo", type=Path, default=REPO, metavar="CHECKOUT")
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("DIR_A", "DIR_B"))
    args, targets = parser.parse_known_args()
    targets = targets or ["tests/kernels"]
    if args.compare:
        return compare(*args.compare)
    if args.dump:
        return dump(args.dump, args.repo.resolve(), targets, args.pdl)
    result = _run_tests(REPO, PLUGIN, targets, {})
    errors = [line for line in result.stdout.splitlines() if line.startswith("E   ")]
    other = [line for line in errors if "Compiled: compiled for sm_90" not in line]
    launches = len(errors) - len(other)
    print(f"{launches} test launches compiled for sm_90; {len(other)} other errors")
    for line in sorted(set(re.sub(r"0x[0-9a-f]+", "0x..", line) for line in other))[:40]:
        print(line)
    return 1 if other or launches == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
