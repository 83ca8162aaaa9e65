"""The requirement files cover every third-party import: a fresh machine that installs them passes.

Runtime imports of ``loom/`` are in the package's ``dependencies`` or ``requirements.txt`` (or, when
imported only inside a function, in one of its extras); every import of ``loom/``, ``tests/`` and
``benchmarks/`` is in ``requirements-dev.txt`` (beside ``-e .``) and in the ``dev`` extra, which list
the same packages.
"""

from __future__ import annotations

import ast
import functools
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"loom", "tests", "benchmarks", "common", "__future__"}


def _imports(folder: str) -> dict[str, bool]:
    """Top-level third-party module -> True when some import of it runs at module load."""
    found: dict[str, bool] = {}
    for path in (ROOT / folder).rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        top_level = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in FIRST_PARTY:
                    continue
                found[top] = found.get(top, False) or id(node) in top_level
    return found


@functools.cache
def _installed() -> dict[str, list[str]]:
    """Top-level module -> the distributions providing it (one scan of the installed metadata)."""
    return dict(packages_distributions())


def _distributions(module: str) -> set[str]:
    """The distributions providing ``module`` (its own name when none is installed here, as tomli on 3.11)."""
    return {canonicalize_name(d) for d in _installed().get(module, [module])}


def _names(lines: list[str]) -> set[str]:
    out = set()
    for line in lines:
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            out.add(canonicalize_name(Requirement(line).name))
    return out


def _file(name: str) -> set[str]:
    lines = (ROOT / name).read_text().splitlines()
    nested = [ln.split()[1] for ln in lines if ln.startswith("-r ")]
    return _names(lines).union(*(_file(n) for n in nested))


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_runtime_imports_are_dependencies():
    project = _project()
    required = _names(project["dependencies"]) | _file("requirements.txt")
    extras = set().union(*(_names(v) for v in project["optional-dependencies"].values()))
    for module, at_load in _imports("loom").items():
        dists = _distributions(module)
        if at_load:
            assert dists & required, (
                f"loom imports {module} at load: add it to dependencies and requirements.txt"
            )
        else:
            assert dists & (required | extras), f"loom imports {module}: add it to dependencies or an extra"


def test_every_import_is_a_dev_requirement():
    project = _project()
    dev_file = _file("requirements-dev.txt") | _names(
        project["dependencies"]
    )  # the README installs with -e .
    dev_extra = _names(project["optional-dependencies"]["dev"]) | _names(project["dependencies"])
    for folder in ("loom", "tests", "benchmarks"):
        for module in _imports(folder):
            dists = _distributions(module)
            assert dists & dev_file, f"{folder}/ imports {module}: add it to requirements-dev.txt"
            assert dists & dev_extra, f"{folder}/ imports {module}: add it to the dev extra of pyproject.toml"


def test_dev_file_and_dev_extra_agree():
    project = _project()
    runtime = _names(project["dependencies"]) - {"torch"}  # torch: the CPU pin is in the file only
    dev_file = (_file("requirements-dev.txt") - {"torch"}) | runtime
    dev_extra = _names(project["optional-dependencies"]["dev"]) | runtime
    assert dev_file == dev_extra, (dev_file - dev_extra, dev_extra - dev_file)
