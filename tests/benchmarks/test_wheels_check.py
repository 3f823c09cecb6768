"""The device wheel-folder check finds what stopped two device calls: a project twice, a dependency nowhere."""

from __future__ import annotations

import zipfile
from pathlib import Path

from benchmarks.device.wheels import check


def write_wheel(folder: Path, name: str, version: str, *requires: str) -> None:
    metadata = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\n{metadata}")


def test_a_complete_folder_passes(tmp_path: Path) -> None:
    write_wheel(
        tmp_path, "huggingface_hub", "2.4.0", "httpx2<3,>=2.0.0", "tqdm>=4.42.1", "tomli; python_version < '3.11'"
    )
    write_wheel(tmp_path, "httpx2", "2.16.2", "rich; extra == 'cli'")
    assert check(tmp_path, {"tqdm"}) == ([], [])


def test_two_versions_a_wrong_version_and_a_missing_dependency_are_reported(tmp_path: Path) -> None:
    write_wheel(tmp_path, "opentelemetry_api", "1.45.2")
    write_wheel(tmp_path, "opentelemetry_api", "1.45.3")
    write_wheel(tmp_path, "httpx2", "2.16.2", "httpcore2==2.16.2")
    write_wheel(tmp_path, "text_generation", "0.7.0", "huggingface-hub<1.0,>=0.12")
    write_wheel(tmp_path, "huggingface_hub", "2.4.0")
    errors, missing = check(tmp_path, set())
    assert errors == [
        "opentelemetry-api: 2 wheels (1.45.2, 1.45.3)",
        "text-generation needs huggingface-hub<1.0,>=0.12, the folder has huggingface-hub 2.4.0",
    ]
    assert missing == ["httpcore2 (for httpx2)"]
