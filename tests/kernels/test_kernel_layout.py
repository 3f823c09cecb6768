"""tgi_compat/kernels/ keeps its shape: families of small modules, imports one way, jit bodies that read as phases.

Read from the source with `ast` (nothing is imported, so the interpreter switch of conftest.py plays no part).
"""

from __future__ import annotations

import ast
import re
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

from tests.import_graph import ROOT, imports_of, module_name

KERNELS = ROOT / "tgi_compat" / "kernels"
MODULES = sorted(KERNELS.rglob("*.py"))
MAX_MODULE_LINES = 400
MAX_JIT_BODY_LINES = 80  # a @triton.jit function's statements, its signature and docstring aside
TUNED_TABLES = {"tuned.py"}  # measured configs, printed by the sweeps
COMPILED_ONLY = {"tgi_compat.kernels.comm.l2_prefetch"}  # no interpreter counterpart: its CPU test compiles it


def test_kernels_import_only_kernels() -> None:
    """The bottom of the stack (docs/architecture.md §1): nothing from the router, modeling or the API."""
    outside = {module_name(p): imports_of(p) - {"tgi_compat.kernels"} for p in MODULES}
    outside = {
        name: [m for m in imports if not m.startswith("tgi_compat.kernels.")] for name, imports in outside.items()
    }
    assert not {name: imports for name, imports in outside.items() if imports}


def test_kernel_modules_import_no_loop() -> None:
    graph = {module_name(p): imports_of(p) for p in MODULES}
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as error:
        pytest.fail(f"import loop: {error.args[1]}")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(KERNELS)))
def test_kernel_module_is_small(path: Path) -> None:
    if path.name not in TUNED_TABLES:
        assert len(path.read_text().splitlines()) <= MAX_MODULE_LINES


def _jit_functions(path: Path) -> list[ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list)
    ]


def _body_lines(function: ast.FunctionDef) -> int:
    body = function.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and len(body) > 1:
        body = body[1:]  # the docstring
    return (function.end_lineno or body[-1].lineno) - body[0].lineno + 1


def test_the_body_counter_sees_the_decode_kernel() -> None:
    functions = {f.name: f for f in _jit_functions(KERNELS / "attention" / "decode.py")}
    assert _body_lines(functions["_decode_stage1_kernel"]) > 40


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(KERNELS)))
def test_jit_bodies_read_as_phases(path: Path) -> None:
    """A long kernel is split into named @triton.jit helpers (Triton inlines them: the same generated code)."""
    long = {f.name: _body_lines(f) for f in _jit_functions(path) if _body_lines(f) > MAX_JIT_BODY_LINES}
    assert not long


def test_every_module_with_jit_functions_is_reimported_interpreted() -> None:
    """tests/kernels/conftest.py re-imports each kernel module under the interpreter, in its own list: one left out
    keeps compiled jit functions, which interpreted callers cannot call (a failure that depends on test order)."""
    conftest = (Path(__file__).parent / "conftest.py").read_text()
    listed = set(re.findall(r'^    "(tgi_compat\.kernels\.[a-z0-9_.]+)",$', conftest, re.MULTILINE))
    with_jit = {module_name(p) for p in MODULES if _jit_functions(p)}
    assert not with_jit - listed - COMPILED_ONLY, sorted(with_jit - listed - COMPILED_ONLY)
