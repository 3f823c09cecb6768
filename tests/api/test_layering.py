"""The project's imports point one way (docs/architecture.md §1), asserted over every module's imports; and
routes stay thin: each route module imports few project modules and no other route module.

Layers, top to bottom: the `python -m` entry shims; in the API, cli → server → routes → serving → lightllm →
{protocol, observability} → config; then the engine, router → modeling → kernels. A module may import its own
layer's modules and any lower layer's, never a higher one's nor a sibling layer's. Lazy and TYPE_CHECKING
imports count too: a cycle hidden inside a function is still a cycle. Counted from the source with `ast`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_graph import ROOT, imports_of, module_name

PACKAGE = ROOT / "tgi_compat"

# (module prefix, rank): the longest matching prefix names a module's layer.
LAYERS = {
    "tgi_compat.launcher": 11,
    "tgi_compat.api_server": 11,
    "tgi_compat.openai_server": 11,
    "tgi_compat.quantize": 11,
    "tgi_compat.api.cli": 10,
    "tgi_compat.api.server": 9,
    "tgi_compat.api.routes": 8,
    "tgi_compat.api.serving": 7,
    "tgi_compat.api.lightllm": 6,
    "tgi_compat.api.protocol": 5,
    "tgi_compat.api.observability": 5,
    "tgi_compat.api.config": 4,
    "tgi_compat.api.lora_flags": 3,
    "tgi_compat.router": 2,
    "tgi_compat.modeling": 1,
    "tgi_compat.kernels": 0,
}


def layer_of(module: str) -> str | None:
    matches = [prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")]
    return max(matches, key=len) if matches else None


MODULES = sorted(PACKAGE.rglob("*.py"))
PACKAGES = ("tgi_compat", "tgi_compat.api")  # their __init__ modules import nothing


def test_every_module_has_a_layer() -> None:
    assert [m for m in map(module_name, MODULES) if layer_of(m) is None and m not in PACKAGES] == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_point_down(path: Path) -> None:
    own = layer_of(module_name(path))
    if own is None:
        return  # a package's __init__ (test_every_module_has_a_layer)
    wrong = []
    for name in sorted(imports_of(path)):
        target = layer_of(name)
        if target is None or target == own:
            continue
        if LAYERS[target] >= LAYERS[own]:
            wrong.append(f"{name} ({target}, rank {LAYERS[target]})")
    assert not wrong, f"{own} (rank {LAYERS[own]}) imports upward or sideways: {wrong}"


def test_the_checker_sees_a_violation() -> None:
    """The checker itself: the serving module that imports protocol would be caught the other way round."""
    frame = PACKAGE / "api" / "serving" / "frame.py"
    targets = {layer_of(name) for name in imports_of(frame)}
    assert "tgi_compat.api.protocol" in targets and "tgi_compat.api.lightllm" in targets
    assert LAYERS["tgi_compat.api.serving"] > LAYERS["tgi_compat.api.protocol"]


# Routes: the work of a route (validation, generation, response shapes, accounting) lives in `serving/`; a route
# parses its body, calls its service and wraps the answer.
ROUTES = PACKAGE / "api" / "routes"
ROUTE_MODULES = sorted(p for p in ROUTES.glob("*.py") if p.name not in ("__init__.py", "auth.py"))  # auth: theirs
MAX_PROJECT_MODULES = 6


def test_the_counter_sees_imports() -> None:
    """The counter itself: a serving module known to import several project modules."""
    imports = imports_of(PACKAGE / "api" / "serving" / "frame.py")
    assert {"tgi_compat.api.serving.state", "tgi_compat.api.serving.accounting"} <= imports


@pytest.mark.parametrize("path", ROUTE_MODULES, ids=lambda p: p.stem)
def test_route_imports_few_project_modules(path: Path) -> None:
    imports = imports_of(path)
    assert len(imports) <= MAX_PROJECT_MODULES, f"{path.name} imports {len(imports)}: {sorted(imports)}"


@pytest.mark.parametrize("path", ROUTE_MODULES, ids=lambda p: p.stem)
def test_route_imports_no_other_route(path: Path) -> None:
    routes = imports_of(path) & {module_name(p) for p in ROUTE_MODULES}
    assert not routes, f"{path.name} imports route modules {sorted(routes)}"
