"""The installed wheel holds no generic top-level package: transformers (and pip) must not take our
engine's `kernels` for Hugging Face's `kernels` distribution, and benchmarks/ stays out.

Builds the wheel from a copy of the sources, installs it by unpacking (a pure-Python wheel), then
asks a fresh interpreter that sees only that install and the venv's site-packages (no .pth files,
so no editable install of this checkout) what transformers' import checks see.
"""

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = ["pyproject.toml", "setup.py", "README.md", "tgi_compat", "router", "modeling", "kernels", "benchmarks"]

PROBE = """
import importlib.util, json, os, sys
install = sys.argv[1]
report = {}
spec = importlib.util.find_spec("kernels")
report["kernels_before"] = spec.origin if spec else None
from transformers.utils import import_utils
report["transformers_kernels"] = list(import_utils._is_package_available("kernels", return_version=True))
report["transformers_kernels_usable"] = import_utils.is_kernels_available()
import tgi_compat
import kernels.rmsnorm, modeling.runner, router.client_api
report["engine"] = [m.__file__ for m in (kernels.rmsnorm, modeling.runner, router.client_api)]
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, source / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), "."],
        cwd=source,
        check=True,
        capture_output=True,
    )
    (path,) = glob.glob(str(out / "*.whl"))
    return path


def test_the_wheel_installs_one_top_level_package_and_no_benchmarks(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"tgi_compat", "tgi_compat-0.1.0.dist-info"}
    engine = {"/".join(name.split("/")[:3]) for name in names if name.startswith("tgi_compat/_engine/")}
    assert engine == {"tgi_compat/_engine/router", "tgi_compat/_engine/modeling", "tgi_compat/_engine/kernels"}
    assert not [name for name in names if "benchmarks/" in name or "/tests/" in name]
    assert zipfile.ZipFile(wheel).read("tgi_compat-0.1.0.dist-info/top_level.txt").split() == [b"tgi_compat"]


def test_transformers_does_not_see_our_kernels_and_the_engine_still_imports(wheel, tmp_path):
    install = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(install)  # what pip does with a pure-Python wheel
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # -S: no site processing, so no .pth (an editable install of a checkout would expose `kernels`).
    command = [
        sys.executable,
        "-S",
        "-c",
        f"import sys; sys.path[1:1] = {[str(install), sysconfig.get_paths()['purelib']]!r}\n" + PROBE,
        str(install),
    ]
    result = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    ours = str(install)
    # Not importable as `kernels` before tgi_compat is: transformers finds no `kernels` of ours.
    assert report["kernels_before"] is None or not report["kernels_before"].startswith(ours)
    if report["kernels_before"] is None:  # no Hugging Face `kernels` installed either
        assert report["transformers_kernels"] == [False, "N/A"] and report["transformers_kernels_usable"] is False
    # After `import tgi_compat` the engine packages import from the wheel's private folder.
    assert all(path.startswith(os.path.join(ours, "tgi_compat", "_engine")) for path in report["engine"])
