"""What pip is told: compatible ranges in pyproject.toml, the exact tested set in constraints.txt, and the two agree
with each other and with what is installed here."""

from __future__ import annotations

import re
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirements() -> list[Requirement]:
    meta = project()
    return [Requirement(r) for r in meta["dependencies"] + [r for rs in meta["optional-dependencies"].values() for r in rs]]


def pins() -> dict[str, Version]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, pinned = line.partition("==")
            assert pinned, f"constraints.txt: {line!r} is not an exact pin"
            out[canonicalize_name(name)] = Version(pinned)
    return out


def test_the_package_states_ranges_not_pins():
    for requirement in requirements():
        assert not any(spec.operator in ("==", "===") for spec in requirement.specifier), requirement
        assert "+" not in str(requirement.specifier), f"{requirement}: a local build tag (+cpu) belongs in constraints.txt"
        assert any(spec.operator == ">=" for spec in requirement.specifier), f"{requirement}: no tested lower bound"


def test_the_tested_set_lies_in_the_ranges_and_is_what_is_installed():
    tested = pins()
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        if name == "tensorflow":  # the gpu extra's; here the cpu extra's tensorflow-cpu is installed and pinned
            continue
        assert name in tested, f"{name} is a dependency but not pinned in constraints.txt"
        assert requirement.specifier.contains(tested[name], prereleases=True), (name, tested[name], requirement)
        try:
            installed = Version(version(requirement.name))
        except PackageNotFoundError:
            raise AssertionError(f"{requirement.name} is pinned but not installed") from None
        # ==2.13.0 admits a local build (2.13.0+cpu, from this machine's disk) as pip does
        assert SpecifierSet(f"=={tested[name]}").contains(installed, prereleases=True), (name, installed, tested[name])
    assert all(pin.local is None for pin in tested.values())  # public versions only: PyPI resolves every pin


def test_requires_python_is_true_of_the_tested_set():
    required = SpecifierSet(project()["requires-python"])
    here = Version(".".join(map(str, sys.version_info[:3])))
    assert here in required
    assert Version("3.10") not in required  # numpy 2.4, scipy 1.17, pandas 3.1 need 3.11
    assert re.fullmatch(r">=3\.\d+", str(required))
