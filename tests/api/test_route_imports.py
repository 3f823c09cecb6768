"""Routes stay thin: each route module imports few project modules and no other route module.

The work of a route (validation, generation, response shapes, accounting) lives in `serving/`; a
route parses its body, calls its service and wraps the answer. Counted from the source with `ast`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROUTES = ROOT / "tgi_compat" / "api" / "routes"
PROJECT_PACKAGES = ("tgi_compat",)
MAX_PROJECT_MODULES = 6


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def project_imports(path: Path) -> set[str]:
    """The project modules `path` imports; `from pkg import mod` counts as `pkg.mod`."""
    package = _module_name(path).rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if _is_module(candidate) else base)
    return {name for name in found if name.split(".")[0] in PROJECT_PACKAGES}


ROUTE_MODULES = sorted(
    p for p in ROUTES.glob("*.py") if p.name not in ("__init__.py", "auth.py")
)  # auth: their dependency


def test_the_counter_sees_imports() -> None:
    """The counter itself: a serving module known to import several project modules."""
    imports = project_imports(ROOT / "tgi_compat" / "api" / "serving" / "frame.py")
    assert {"tgi_compat.api.serving.state", "tgi_compat.api.serving.accounting"} <= imports


@pytest.mark.parametrize("path", ROUTE_MODULES, ids=lambda p: p.stem)
def test_route_imports_few_project_modules(path: Path) -> None:
    imports = project_imports(path)
    assert len(imports) <= MAX_PROJECT_MODULES, f"{path.name} imports {len(imports)}: {sorted(imports)}"


@pytest.mark.parametrize("path", ROUTE_MODULES, ids=lambda p: p.stem)
def test_route_imports_no_other_route(path: Path) -> None:
    route_names = {f"tgi_compat.api.routes.{p.stem}" for p in ROUTE_MODULES}
    routes = project_imports(path) & route_names
    assert not routes, f"{path.name} imports route modules {sorted(routes)}"
