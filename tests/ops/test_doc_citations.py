"""Every "§" citation in the code names a file in docs/ and a section heading that exists there."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CODE_DIRS = [
    "tgi_compat",
    "tests",
    "integration-tests",
    "benchmarks",
    "scripts",
    "docker",
    "docs/benchmarks",  # BENCHMARKS.md's dated sections
]
CODE_FILES = ["Dockerfile", "Makefile", "pyproject.toml", "README.md", "BENCHMARKS.md"]
CITATION = re.compile(r"(docs/[\w-]+\.md) §")
SECTION = re.compile(r"§(\d+(?:\.\d+)*)(?:-§?(\d+(?:\.\d+)*))?")
HEADING = re.compile(r"^#{2,4} (\d+(?:\.\d+)*)\.? ", re.MULTILINE)


def sources():
    for name in CODE_FILES:
        yield os.path.join(ROOT, name)
    for folder in CODE_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for filename in filenames:
                if filename.endswith((".py", ".md", ".sh", ".toml", ".json", ".txt")):
                    yield os.path.join(dirpath, filename)


def headings(doc: str) -> set[str]:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return set(HEADING.findall(f.read()))


def test_every_section_citation_resolves_in_docs():
    dangling = []
    for path in sources():
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        for number, line in enumerate(lines, 1):
            if "§" not in line or path == __file__:
                continue
            docs = CITATION.findall(line)
            where = f"{os.path.relpath(path, ROOT)}:{number}"
            if not docs:
                dangling.append(f"{where}: names no docs/ file: {line.strip()}")
                continue
            if not os.path.isfile(os.path.join(ROOT, docs[0])):
                dangling.append(f"{where}: {docs[0]} does not exist")
                continue
            known = headings(docs[0])
            for first, last in SECTION.findall(line):
                for section in filter(None, (first, last)):
                    if section not in known:
                        dangling.append(f"{where}: {docs[0]} has no section {section}")
    assert not dangling, "\n".join(dangling)


def test_the_contract_keeps_its_section_numbers():
    expected = {str(n) for n in range(1, 19)} | {"4.1", "4.2", "9.1", "9.2", "9.3", "9.4", "9.5"}
    assert expected <= headings("docs/contract.md")
