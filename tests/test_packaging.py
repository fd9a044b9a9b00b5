"""The ``test`` extra installs everything the tests import (issue 10, item 18).

Regression: three tests needed matplotlib and mkdocs, which ``pip install -e ".[test]"`` did not
install, so the README's test command failed on a fresh machine while CI (which installed
more) stayed green. This reads every import of the code the suite runs (tests, examples,
bench, the Python blocks of docs/) and checks that each third-party distribution it needs is
a core dependency or in the ``test`` extra.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCAL = {"fitdp", "tests", "bench", "examples", "conftest"}


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def _imported_modules(source: str) -> set[str]:
    """Top-level modules ``source`` imports, less those it falls back from on ImportError
    (an optional peer such as Lightning in ``bench/distributed.py``)."""
    tree = ast.parse(source)
    optional = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) and any(
        isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
        for h in t.handlers) for n in ast.walk(t)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _sources() -> list[tuple[str, str]]:
    files = [p for d in ("tests", "examples", "bench") for p in (ROOT / d).rglob("*.py")]
    out = [(str(p.relative_to(ROOT)), p.read_text()) for p in files]
    fence = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
    for page in (ROOT / "docs").rglob("*.md"):
        out += [(str(page.relative_to(ROOT)), b) for b in fence.findall(page.read_text())]
    return out


def test_the_test_extra_installs_everything_the_suite_imports():
    # what `pip install -e ".[test]"` installed: fitdp's own metadata, core and test extra
    reqs = md.requires("fitdp") or []
    allowed = _requirement_names([r for r in reqs if "extra ==" not in r or
                                  re.search(r"extra\s*==\s*['\"]test['\"]", r)])
    local = LOCAL | {p.stem for d in ("tests", "bench", "examples")
                     for p in (ROOT / d).rglob("*.py")}
    dists = md.packages_distributions()
    missing: dict[str, set[str]] = {}
    for where, source in _sources():
        for module in _imported_modules(source) - local - set(sys.stdlib_module_names):
            names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
            # a module several distributions provide is fine when one of them is required
            if not names & allowed and not _required_by(names, allowed):
                missing.setdefault(module, set()).add(where)
    assert not missing, f"imported by the suite but not installed by the test extra: {missing}"


def _required_by(names: set[str], allowed: set[str]) -> bool:
    """Whether a distribution in ``names`` comes with a required one (e.g. torch's numpy)."""
    for dist in allowed:
        try:
            reqs = md.requires(dist) or []
        except md.PackageNotFoundError:
            continue
        plain = [r for r in reqs if "extra ==" not in r]
        if _requirement_names(plain) & names:
            return True
    return False


def test_the_detector_sees_a_missing_package():
    source = ("import numpy\nfrom some_package_nobody_installs.sub import thing\n"
              "try:\n    import optional_peer\nexcept ImportError:\n    pass\n")
    assert _imported_modules(source) == {"numpy", "some_package_nobody_installs"}


def test_install_docs_say_which_torch_build_the_pin_takes():
    """Regression: README said torch==2.13.0 is pinned "so that pip takes the CPU build"; from
    PyPI the pin pulls the CUDA build and its nvidia packages. The docs say so and give the
    CPU index."""
    for page in (ROOT / "README.md", ROOT / "docs" / "index.md"):
        text = " ".join(page.read_text().split())
        assert "takes the CPU build" not in text and "# the CPU build" not in text, page
        assert "CUDA build" in text and "nvidia-*" in text, page
        assert "--index-url https://download.pytorch.org/whl/cpu" in text, page


def test_the_package_metadata_carries_fitdp_version(tmp_path):
    """Regression (issue 17 item 20): ``fitdp.__version__`` said 0.2.0 while the metadata
    pyproject.toml gave pip said 0.1.0. The version lives in fitdp/_version.py alone and the
    metadata setuptools builds from this pyproject.toml reads it from there."""
    import shutil
    import subprocess

    import fitdp

    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "fitdp", tmp_path / "fitdp",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "meta"
    out.mkdir()
    build = ("import sys, setuptools.build_meta as b; "
             "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))")
    info = subprocess.run([sys.executable, "-c", build, str(out)], cwd=tmp_path, check=True,
                          capture_output=True, text=True, timeout=300).stdout.split()[-1]
    metadata = (out / info / "METADATA").read_text()
    assert re.search(r"^Version: (\S+)$", metadata, re.M).group(1) == fitdp.__version__
    # the [project] table (tomllib is Python 3.11+; fitdp supports 3.10)
    project = (ROOT / "pyproject.toml").read_text().split("\n[project]\n")[1].split("\n[")[0]
    assert not re.search(r"^version\s*=", project, re.M)
    assert re.search(r"^dynamic\s*=\s*\[\s*\"version\"", project, re.M)


def test_no_page_or_docstring_points_to_an_api_md_that_is_not_there():
    """Regression (issue 17 item 20): docs/api.md and the compile/fit docstrings sent readers
    to an ``API.md`` the project does not have; the reference is docs/api.md."""
    bad = [str(p.relative_to(ROOT)) for d in ("fitdp", "docs") for p in (ROOT / d).rglob("*")
           if p.suffix in (".py", ".md") and re.search(r"(?<![\w/])API\.md", p.read_text())]
    assert not bad, f"these point to a missing API.md: {bad}"
