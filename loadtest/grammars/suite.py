"""The JSON-Schema-Test-Suite's draft 2020-12 cases (json-schema-org's, shipped inside the
``jsonschema`` package's source distribution): each a schema with instances the suite says are
valid or not. Read from ``--suite DIR`` (the suite's ``tests/draft2020-12``), else fetched once with
``pip download`` into ``~/.cache/pagedserve/json-schema-test-suite``."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from typing import Any

CACHE = os.path.expanduser("~/.cache/pagedserve/json-schema-test-suite")
SDIST = "jsonschema==4.26.0"
SKIPPED = ("refRemote.json",)  # its schemas point at http://localhost:1234, which nothing serves
REMOTE = "localhost:1234"  # other files' cases that do too


@dataclass(frozen=True)
class Case:
    file: str
    description: str
    schema: Any
    valid: list[Any]
    invalid: list[Any]


def suite_dir(given: str | None) -> str:
    if given:
        return given
    if not glob.glob(os.path.join(CACHE, "*.json")):
        _fetch(CACHE)
    return CACHE


def _fetch(into: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", tmp,
                        SDIST], check=True)
        (archive,) = glob.glob(os.path.join(tmp, "jsonschema-*.tar.gz"))
        os.makedirs(into, exist_ok=True)
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                parts = member.name.split("/")
                if parts[1:4] == ["json", "tests", "draft2020-12"] and len(parts) == 5 and parts[4].endswith(".json"):
                    with open(os.path.join(into, parts[4]), "wb") as out:
                        out.write(tar.extractfile(member).read())


def load_cases(directory: str) -> list[Case]:
    cases = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        name = os.path.basename(path)
        if name in SKIPPED:
            continue
        with open(path) as f:
            for group in json.load(f):
                tests = group["tests"]
                if REMOTE in json.dumps(group["schema"]):
                    continue
                cases.append(Case(name, group["description"], group["schema"],
                                  [t["data"] for t in tests if t["valid"]], [t["data"] for t in tests if not t["valid"]]))
    return cases
