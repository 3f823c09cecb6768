"""Every ServerConfig field does something: some code reads it, or the launcher names it as accepted
but not built (`_NOT_IMPLEMENTED`, which warns when one is set) or as without effect by design."""

import dataclasses
import glob
import os
import re

from tgi_compat.api.cli import launcher
from tgi_compat.api.config import ServerConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _source_of(paths: list[str]) -> str:
    text = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text.append(f.read())
    return "\n".join(text)


def test_every_server_config_field_is_read_or_listed_as_not_built():
    modules = [p for p in glob.glob(os.path.join(ROOT, "tgi_compat", "**", "*.py"), recursive=True)]
    code = _source_of(modules)
    launcher_code = _source_of([launcher.__file__])
    not_built = launcher_code[launcher_code.index("_NOT_IMPLEMENTED") :]
    not_built = not_built[: not_built.index("\n}\n")]
    unused = []
    for field in dataclasses.fields(ServerConfig):
        attribute = re.compile(rf"\.{field.name}\b")
        reads = [m for m in attribute.finditer(code)]
        listed = attribute.search(not_built) is not None or field.name in launcher._WITHOUT_EFFECT
        if not reads and not listed:
            unused.append(field.name)
    assert not unused, f"ServerConfig fields neither read nor listed as not built: {unused}"


def test_the_not_built_list_warns_for_each_option_it_names():
    config = dataclasses.replace(ServerConfig(), ngrok_edge="e", shard_uds_path="/x", quantize="gptq", ngrok=False)
    missing = launcher.unimplemented_options(config)
    assert any(name.startswith("--ngrok") for name in missing)
    assert "--shard-uds-path" in missing  # --master-addr/--master-port are built (tensor parallelism)
    assert launcher.unimplemented_options(ServerConfig()) == []
