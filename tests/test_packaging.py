"""Tier 1: the install uses the package registries only.

A requirement pinned to a local file (``pkg @ file:///tmp/whl/...``) installs on the machine that wrote
it and nowhere else, and CI on that same machine stays green. Every requirement is ``name==version``.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from tests.helpers import REPO

# Files that say what gets installed, and how.
INSTALL_FILES = sorted(
    [*(REPO / "requirements").iterdir(), REPO / "pyproject.toml", REPO / "Makefile", *(REPO / "scripts").iterdir()]
)
LOCAL = re.compile(r"file:|\s@\s|(?<![\w$}.])/tmp/|(?<![\w$}.])/(?:home|root|opt|mnt|work)/")
PIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[\w,-]+\])?==[0-9][\w.+!-]*$")


def _name(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def local_references(path: Path) -> list[str]:
    """The lines of ``path`` that point at a file on this machine instead of a registry."""
    return [
        f"{_name(path)}:{n}: {line.strip()}"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if LOCAL.search(line.split("#", 1)[0])
    ]


def unpinned_lines(lock: Path) -> list[str]:
    return [
        f"{_name(lock)}:{n}: {line.strip()}"
        for n, line in enumerate(lock.read_text().splitlines(), 1)
        if line.strip() and not line.startswith("#") and not PIN.match(line.strip())
    ]


@pytest.mark.parametrize("path", INSTALL_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_local_paths_in_install_files(path):
    assert local_references(path) == [], "install from the registries: pin `name==version`, never a local file"


def test_lock_pins_every_package_by_name_and_version():
    locks = sorted((REPO / "requirements").glob("*.lock"))
    assert locks
    for lock in locks:
        assert unpinned_lines(lock) == []


def test_pyproject_dependencies_are_registry_requirements():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = meta["dependencies"] + [r for extra in meta["optional-dependencies"].values() for r in extra]
    assert [r for r in requirements if "@" in r or "file:" in r] == []


def test_the_checks_catch_a_file_pin(tmp_path):
    """The regression this guards against, written out: the checks above fail on it. (Written outside the
    repository: the other pytest worker may be reading requirements/ at the same time.)"""
    lock = tmp_path / "probe.lock"
    lock.write_text(
        "megatron-core @ file:///tmp/whl/megatron_core-0.16.1-cp311-cp311-manylinux_2_28_x86_64.whl\nvllm-cpu==0.32.0\n"
    )
    assert local_references(lock) and unpinned_lines(lock) == [
        "probe.lock:1: megatron-core @ file:///tmp/whl/megatron_core-0.16.1-cp311-cp311-manylinux_2_28_x86_64.whl"
    ]


def test_every_source_folder_is_a_listed_package():
    """The editable install finds any subfolder; a wheel (``pip install .``) ships only the listed packages."""
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: REPO / path for name, path in tool["package-dir"].items()}
    shipped = set()
    for package in tool["packages"]:
        top = max((n for n in folders if package == n or package.startswith(n + ".")), key=len)
        shipped.add(folders[top].joinpath(*package.removeprefix(top).strip(".").split(".")).resolve())
    with_code = {
        p.parent.resolve() for top in folders.values() for p in top.rglob("*.py") if "__pycache__" not in p.parts
    }
    assert sorted(map(str, with_code - shipped)) == []
