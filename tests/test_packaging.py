"""Packaging: license, metadata, one version source, py.typed, an sdist that carries the
tests, and every environment variable documented."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import hipmla

REPO = Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


@pytest.fixture(scope="module")
def setuptools_config() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_license_is_apache_2_and_declared(project):
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # PEP 639: the expression only


def test_metadata_is_complete(project):
    assert project["authors"] == [{"name": "hipmla developers"}]
    assert project["requires-python"] == ">=3.10"
    assert project["readme"] == "README.md" and project["description"]
    classifiers = project["classifiers"]
    for expected in ("Programming Language :: Python :: 3", "Typing :: Typed", "Operating System :: POSIX :: Linux"):
        assert expected in classifiers
    low = int(project["requires-python"].removeprefix(">=3."))
    for c in classifiers:
        m = re.fullmatch(r"Programming Language :: Python :: 3\.(\d+)", c)
        assert m is None or int(m.group(1)) >= low, c
    assert project.get("urls") is None  # no invented addresses


def test_one_version_source(project, setuptools_config):
    assert "version" not in project and "version" in project["dynamic"]
    assert setuptools_config["dynamic"]["version"] == {"attr": "hipmla.__version__"}
    init = (REPO / "hipmla" / "__init__.py").read_text()
    assert re.search(r'^__version__ = "\d+\.\d+\.\d+[^"]*"$', init, re.M)
    assert hipmla.__version__
    others = [p.name for p in (REPO / "hipmla").rglob("*.py")
              if p != REPO / "hipmla" / "__init__.py" and re.search(r"^__version__\s*=", p.read_text(), re.M)]
    assert others == []


def test_py_typed_ships(setuptools_config):
    assert (REPO / "hipmla" / "py.typed").is_file()
    assert "py.typed" in setuptools_config["package-data"]["hipmla"]


def test_test_extra_has_what_the_tests_and_scripts_need(project):
    names = {re.split(r"[<>=;\s\[]", r, maxsplit=1)[0].lower() for r in project["optional-dependencies"]["test"]}
    assert {"pytest", "pytest-xdist", "nvidia-cuda-nvrtc"} <= names
    assert "torch" in project["optional-dependencies"]  # kept


def test_manifest_takes_the_tests_and_kernel_sources():
    lines = (REPO / "MANIFEST.in").read_text().splitlines()
    for needed in ("graft tests", "graft hip_src", "graft docs"):
        assert needed in lines
    assert (REPO / "tests" / "conftest.py").is_file() and (REPO / "tests" / "host_harness.py").is_file()


def _setuptools_version() -> tuple[int, ...]:
    try:
        import setuptools
    except ImportError:
        return (0,)
    return tuple(int(x) for x in re.findall(r"\d+", setuptools.__version__)[:2])


@pytest.mark.skipif(_setuptools_version() < (77,), reason="the build backend needs setuptools >= 77 (test extra)")
def test_sdist_carries_everything_the_tests_need(tmp_path):
    # Build from a copy, with the installed backend (no network, nothing written here).
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.egg-info", "build", "dist", "*.co", ".pytest_cache", ".whl"))
    out = tmp_path / "dist"
    out.mkdir()
    code = "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))"
    r = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    sdist = out / r.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        pkg_info = tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("/PKG-INFO")
                                        and m.name.count("/") == 1)).read().decode()
    for needed in ("LICENSE", "README.md", "pyproject.toml", "MANIFEST.in", "hipmla/py.typed",
                   "tests/conftest.py", "tests/host_harness.py", "tests/test_cli.py",
                   "hip_src/params.h", "hip_src/decode/split.hip", "hip_src/nvidia/hip_on_cuda.c",
                   "docs/ENVIRONMENT.md"):
        assert needed in names, needed
    tracked_tests = {p.relative_to(REPO).as_posix() for p in (REPO / "tests").glob("*.py")}
    assert tracked_tests <= names
    assert not any(n.endswith((".co", ".pyc")) for n in names)
    assert f"Version: {hipmla.__version__}" in pkg_info
    assert "License-Expression: Apache-2.0" in pkg_info and "Author: hipmla developers" in pkg_info


# --- environment variables ------------------------------------------------------------------

_READS = [
    re.compile(r"""os\.environ\.get\(\s*["']([A-Z_][A-Z0-9_]*)["']"""),
    re.compile(r"""os\.environ\[\s*["']([A-Z_][A-Z0-9_]*)["']\s*\]"""),
    re.compile(r"""os\.getenv\(\s*["']([A-Z_][A-Z0-9_]*)["']"""),
    re.compile(r"""os\.environ\.setdefault\(\s*["']([A-Z_][A-Z0-9_]*)["']"""),
    re.compile(r"""\bgetenv\(\s*"([A-Z_][A-Z0-9_]*)"\s*\)"""),  # C
]


def variables_read() -> set[str]:
    found = set()
    files = list((REPO / "hipmla").rglob("*.py")) + [p for p in (REPO / "hip_src").rglob("*")
                                                     if p.suffix in (".c", ".h", ".hip")]
    for path in files:
        text = path.read_text()
        for pattern in _READS:
            found.update(pattern.findall(text))
    return found


def test_every_environment_variable_is_documented():
    found = variables_read()
    assert {"HIPMLA_PLATFORM", "HIPMLA_CACHE_DIR", "HIPMLA_NVRTC", "HIPMLA_LIBCUDA", "XDG_CACHE_HOME"} <= found
    doc = (REPO / "docs" / "ENVIRONMENT.md").read_text()
    missing = sorted(v for v in found if f"`{v}`" not in doc)
    assert missing == [], f"read by the code, not in docs/ENVIRONMENT.md: {missing}"
