"""What pip is told: compatible ranges in pyproject.toml, the exact tested set in constraints.txt, and the two agree
with each other and with what is installed here. Both name only what any package index can serve (PyPI names and
public versions: no local build tags, URLs or paths), and so does the metadata the package is built with.

No resolver run against PyPI happens here (the fast tier has no network, and a local folder of wheels would not be
PyPI): docs/install.md records those dry runs. What is checked offline is what a resolver would be given."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from email.message import Message
from email.parser import Parser
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def project() -> dict:
    return pyproject()["project"]


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
        if name == "tensorflow":  # the gpu-tf extra's; here the cpu extra's tensorflow-cpu is installed and pinned
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


def public(text: str, where: str) -> Requirement:
    """``text`` as a requirement any index can satisfy: a name, public versions, no URL or path."""
    assert not text.startswith("-"), f"{where}: {text!r} is a pip option (an index, a link, an editable path)"
    assert "file:" not in text.lower(), f"{where}: {text!r} points at a file"
    try:
        requirement = Requirement(text)
    except InvalidRequirement as e:  # a bare path (./wheels/torch.whl) is not a requirement
        raise AssertionError(f"{where}: {text!r} is not a PyPI-style requirement ({e})") from None
    assert requirement.url is None, f"{where}: {text!r} names a URL"
    for spec in requirement.specifier:
        assert "+" not in spec.version, f"{where}: {text!r} names a local build ({spec.version}): one machine's"
    return requirement


def test_every_requirement_names_a_public_release():
    meta = pyproject()
    for text in meta["build-system"]["requires"]:
        public(text, "[build-system] requires")
    for text in meta["project"]["dependencies"]:
        public(text, "[project] dependencies")
    for extra, texts in meta["project"]["optional-dependencies"].items():
        for text in texts:
            public(text, f"extra {extra!r}")
    for number, line in enumerate((ROOT / "constraints.txt").read_text().splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            public(line.strip(), f"constraints.txt:{number}")


def test_the_extras_choose_one_tensorflow_build_each():
    """docs/install.md: TensorFlow's CPU build for cpu and gpu-torch (PyPI's torch for Linux is a CUDA 13 build,
    tensorflow[and-cuda] takes CUDA 12 wheels), its CUDA 12 build for gpu-tf. No extra mixes the two CUDA majors."""
    extras = {name: [Requirement(r) for r in rs] for name, rs in project()["optional-dependencies"].items()}
    builds = {name: sorted(str(r) for r in rs if canonicalize_name(r.name).startswith("tensorflow"))
              for name, rs in extras.items()}
    assert builds == {"cpu": ["tensorflow-cpu>=2.21"], "gpu-torch": ["tensorflow-cpu>=2.21"],
                      "gpu-tf": ["tensorflow[and-cuda]>=2.21"], "test": []}
    install = (ROOT / "docs" / "install.md").read_text()
    for name in extras:
        assert f"[{name}" in install or f",{name}]" in install, f"docs/install.md does not show the extra {name!r}"


@pytest.fixture(scope="module")
def built_metadata(tmp_path_factory) -> tuple[Message, Path]:
    """The wheel's METADATA, made by the build backend the way pip makes it (prepare_metadata_for_build_wheel), from a
    copy of the sources so that the checkout gets no egg-info. Offline and without build isolation: the backend is
    the one installed here, so it must satisfy [build-system] requires."""
    system = pyproject()["build-system"]
    for text in system["requires"]:
        requirement = Requirement(text)
        try:
            installed = Version(version(requirement.name))
        except PackageNotFoundError:
            raise AssertionError(f"{requirement.name} (the build backend) is not installed here") from None
        assert requirement.specifier.contains(installed), f"{requirement.name} {installed} here, [build-system]: {text}"
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "distmis", source / "distmis", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("metadata")
    build = ("import importlib, sys; "
             f"importlib.import_module({system['build-backend']!r}).prepare_metadata_for_build_wheel(sys.argv[1])")
    done = subprocess.run([sys.executable, "-c", build, str(out)], cwd=source, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (dist_info,) = out.glob("*.dist-info")
    return Parser().parsestr((dist_info / "METADATA").read_text()), dist_info


def test_the_built_metadata_requires_public_releases_only(built_metadata):
    metadata, _ = built_metadata
    extras = set(metadata.get_all("Provides-Extra") or [])
    assert extras == set(project()["optional-dependencies"])
    stated = {(None, str(Requirement(r))) for r in project()["dependencies"]}
    stated |= {(extra, str(Requirement(r))) for extra, rs in project()["optional-dependencies"].items() for r in rs}
    built = set()
    for text in metadata.get_all("Requires-Dist") or []:
        requirement = public(text, "Requires-Dist")
        extra = None
        if requirement.marker is not None:
            (extra,) = [e for e in extras if requirement.marker.evaluate({"extra": e})]
            requirement.marker = None
        built.add((extra, str(requirement)))
    assert built == stated  # the metadata says what pyproject.toml says, nothing more


def test_the_built_metadata_states_the_license(built_metadata):
    metadata, dist_info = built_metadata
    assert Version(metadata["Metadata-Version"]) >= Version("2.4")  # PEP 639
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License") is None  # the expression replaces the free-text field
    assert not [c for c in metadata.get_all("Classifier") or [] if c.startswith("License ::")]
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert (dist_info / "licenses" / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes()
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
