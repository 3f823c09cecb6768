"""One import root: the wheel installs `tgi_compat` and nothing else, and Hugging Face's `kernels`
(a transformers dependency since 5.25) imports beside our engine in one process.

Builds the wheel from a copy of the sources, installs it by unpacking (a pure-Python wheel), then
asks a fresh interpreter that sees only that install and the venv's site-packages (no .pth files,
so no editable install of this checkout) what it imports.
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
SOURCES = ["pyproject.toml", "README.md", "tgi_compat", "benchmarks"]
ENGINE = ("tgi_compat.kernels.elementwise.rmsnorm", "tgi_compat.modeling.runner", "tgi_compat.router.client_api")

PROBE = f"""
import importlib, json, sys
path_before = list(sys.path)
import tgi_compat
report = {{"path_added": [p for p in sys.path if p not in path_before]}}
engine = [importlib.import_module(name) for name in {ENGINE!r}]
report["engine"] = [module.__file__ for module in engine]
import kernels  # Hugging Face's, after our engine is loaded
report["hf_kernels"] = kernels.__file__
from transformers.utils import import_utils
report["transformers_kernels_usable"] = import_utils.is_kernels_available()
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
    assert {name.split("/")[0] for name in names} == {"tgi_compat", "tgi_compat-0.1.0.dist-info"}
    parts = {name.split("/")[1] for name in names if name.startswith("tgi_compat/") and name.count("/") >= 2}
    assert {"api", "router", "modeling", "kernels"} <= parts
    assert not [name for name in names if "benchmarks/" in name or "/tests/" in name]
    assert zipfile.ZipFile(wheel).read("tgi_compat-0.1.0.dist-info/top_level.txt").split() == [b"tgi_compat"]


@pytest.mark.latest_deps
def test_hf_kernels_and_our_engine_import_in_one_process(wheel, tmp_path):
    pytest.importorskip("kernels", reason="Hugging Face's kernels is a transformers dependency from 5.25")
    install = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(install)  # what pip does with a pure-Python wheel
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # -S: no site processing, so no .pth (the editable install of this checkout stays out of sight).
    command = [
        sys.executable,
        "-S",
        "-c",
        f"import sys; sys.path[1:1] = {[str(install), sysconfig.get_paths()['purelib']]!r}\n" + PROBE,
    ]
    result = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["path_added"] == []  # importing tgi_compat edits no sys.path
    assert all(path.startswith(os.path.join(str(install), "tgi_compat")) for path in report["engine"])
    assert not report["hf_kernels"].startswith(str(install))  # `kernels` is Hugging Face's, from site-packages
    assert report["transformers_kernels_usable"] is True
