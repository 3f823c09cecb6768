"""Check the wheel folder a device call carries (`.whl`), here, before a call spends device time on it.

The device installs every wheel with `pip install --no-deps --target /tmp/site .whl/*.whl`, so pip checks
nothing: two versions of one project stop the whole install, and a dependency that neither the folder nor the
device image holds fails at the first import (session 22 lost two device calls that way: a second
opentelemetry-api, then huggingface-hub 2.4's httpcore2). This reads each wheel's metadata and reports:

- projects with more than one wheel (an error);
- requirements that a wheel of the folder does not satisfy (an error: the wrong version was downloaded);
- requirements that no wheel provides, which the device image must hold (a list to read, not an error unless
  `--strict`): a project the image lacks belongs in the folder.

    python -m benchmarks.device.wheels [--dir .whl] [--image-has torch,numpy,...] [--strict]
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from collections import defaultdict
from email.parser import HeaderParser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

# the device's python and platform: requirements' markers are read as they are there
DEVICE_MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "extra": "",
}
# what earlier device calls imported from the image itself (PyTorch and Triton are its own, KINDS.md)
IMAGE_HAS = (
    "torch,triton,numpy,packaging,pyyaml,filelock,fsspec,tqdm,jinja2,markupsafe,typing-extensions,sympy,networkx"
)


def requirements_of(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = HeaderParser().parsestr(archive.read(name).decode())
    requirements = [Requirement(line) for line in metadata.get_all("Requires-Dist") or []]
    return [r for r in requirements if r.marker is None or r.marker.evaluate(DEVICE_MARKERS)]


def check(folder: Path, image_has: set[str]) -> tuple[list[str], list[str]]:
    """(errors, what the image must hold) for the wheels in `folder`."""
    versions: dict[str, list[Version]] = defaultdict(list)
    wheels = sorted(folder.glob("*.whl"))
    for wheel in wheels:
        name, version, _, _ = parse_wheel_filename(wheel.name)
        versions[name].append(version)
    errors = [f"{name}: {len(v)} wheels ({', '.join(map(str, v))})" for name, v in versions.items() if len(v) > 1]
    needed_from_image: dict[str, set[str]] = defaultdict(set)
    for wheel in wheels:
        owner = parse_wheel_filename(wheel.name)[0]
        for requirement in requirements_of(wheel):
            name = canonicalize_name(requirement.name)
            if name in versions:
                if not any(requirement.specifier.contains(v, prereleases=True) for v in versions[name]):
                    errors.append(f"{owner} needs {requirement}, the folder has {name} {versions[name][0]}")
            elif name not in image_has:
                needed_from_image[name].add(owner)
    missing = [f"{name} (for {', '.join(sorted(owners))})" for name, owners in sorted(needed_from_image.items())]
    return errors, missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path(".whl"))
    parser.add_argument("--image-has", default=IMAGE_HAS, help="projects the device image holds (comma list)")
    parser.add_argument("--strict", action="store_true", help="a requirement no wheel provides is an error too")
    args = parser.parse_args()
    errors, missing = check(args.dir, {canonicalize_name(n) for n in args.image_has.split(",") if n})
    for line in errors:
        print(f"error: {line}")
    for line in missing:
        print(f"{'error' if args.strict else 'the image must hold'}: {line}")
    return 1 if errors or (args.strict and missing) else 0


if __name__ == "__main__":
    sys.exit(main())
