"""Which installed distributions differ from a pip-compile lock: `make test-latest` prints it before
the smoke set runs, and again as the likely cause when the smoke set fails.

    python scripts/lock_drift.py requirements/dev.txt [NAME==VERSION ...] [--failed]
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: str) -> dict[str, str]:
    with open(path, encoding="utf-8") as f:
        return {canonical(m[1]): m[2] for line in f if (m := PIN.match(line))}


def drift(lock: dict[str, str]) -> list[str]:
    installed = {canonical(d.metadata["Name"]): d.version for d in metadata.distributions()}
    lines = []
    for name in sorted(set(lock) | set(installed)):
        locked, now = lock.get(name), installed.get(name)
        if locked is not None and now is not None and locked != now:
            lines.append(f"  {name}: {locked} (lock) -> {now}")
        elif locked is None and now is not None and name not in ("tgi-compat", "torch"):
            lines.append(f"  {name}: not in the lock -> {now}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("lock")
    parser.add_argument("pins", nargs="*", help="pins installed outside the lock (--no-deps), NAME==VERSION")
    parser.add_argument("--failed", action="store_true", help="word the report as the cause of a failed smoke set")
    args = parser.parse_args(argv)
    lock = read_lock(args.lock) | {canonical(name): version for name, version in (p.split("==") for p in args.pins)}
    lines = drift(lock)
    if args.failed:
        print("\nThe newest dependencies that pyproject.toml allows break the smoke set (tests marked latest_deps).")
        print(f"What differs from {args.lock}, the versions main is tested with:")
    else:
        print(f"Newest allowed dependencies: {len(lines)} differ from {args.lock}")
    print("\n".join(lines) or "  (none)")
    if args.failed:
        print("Bound the culprit in pyproject.toml (or fix the code), then `make lock`.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
