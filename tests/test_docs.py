"""The docs run as written: every ```python block, and a strict MkDocs build.

Convention for docs/*.md and README.md: a ```python block runs. The blocks of one page are
one script (in order, so later blocks use earlier names), run in a fresh namespace in a
temporary working directory. Code that must not run here (GPU only, servers, torchrun) goes in
```text or ```bash blocks. Other spellings of Python fences (```py, ```pycon, ...) are refused,
so no snippet silently escapes the test.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[^\s`]*)")
UNTESTED_PYTHON = {"py", "py3", "python3", "pycon", "ipython", "python-repl"}


def fenced_blocks(page: Path) -> list[tuple[str, int, list[str]]]:
    """``(language, line number of its first line (1-based), lines)`` of every fenced block."""
    blocks, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence, lang = m["indent"], m["fence"], m["lang"].lower()
        body, start = [], i + 2
        i += 1
        while i < len(lines) and lines[i].strip() != fence:
            line = lines[i]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            i += 1
        blocks.append((lang, start, body))
        i += 1
    return blocks


def page_script(page: Path) -> str:
    """The page's python blocks as one script whose line numbers are the page's."""
    lines = [""] * (len(page.read_text().splitlines()) + 1)
    for lang, start, body in fenced_blocks(page):
        if lang == "python":
            lines[start:start + len(body)] = body
    return "\n".join(lines[1:]) + "\n"


def _has_python(page: Path) -> bool:
    return any(lang == "python" for lang, _, _ in fenced_blocks(page))


@pytest.mark.parametrize("page", [p for p in PAGES if _has_python(p)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # files the snippets write land here
    threads, root = torch.get_num_threads(), logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    code = compile(page_script(page), str(page), "exec")  # tracebacks point into the page
    torch.set_num_threads(1)  # tiny models: one thread each is fastest, and CI cores are shared
    try:
        exec(code, {"__name__": f"docs.{page.stem}"})  # not "__main__": servers stay off
    except ImportError as err:
        missing = missing_extra(err)
        if missing is None:
            raise
        pytest.skip(f"{page.name} needs the optional {missing!r}, which is not installed")
    finally:
        torch.set_num_threads(threads)
        root.setLevel(level)
        root.handlers[:] = handlers


# Optional extras (pyproject.toml) a page may use, directly or through fitdp: a base install
# skips such a page (issue 39 item 6) instead of failing with ModuleNotFoundError.
EXTRAS = {"torchdata", "transformers", "datasets", "tokenizers", "mlflow", "keras", "onnx",
          "onnxscript", "onnxruntime", "tensorboard", "matplotlib", "safetensors", "torchvision"}


def missing_extra(err: BaseException | None) -> str | None:
    """The optional extra whose import failed in ``err`` or the errors it was raised from
    (fitdp words its own ImportError for a missing extra, from torch's), or None."""
    while err is not None:
        name = getattr(err, "name", None) if isinstance(err, ImportError) else None
        if name and name.split(".")[0] in EXTRAS:
            return name.split(".")[0]
        err = err.__cause__ or err.__context__
    return None


def test_a_page_that_needs_a_missing_extra_is_skipped_not_failed() -> None:
    """Regression (issue 39 item 6): a base install failed the pages whose blocks use an
    extra with ModuleNotFoundError; the error chain names the extra, another import error
    is not taken for one."""
    try:
        try:
            raise ModuleNotFoundError("no mlflow", name="mlflow")
        except ImportError as inner:
            raise ImportError("MLflowLogger needs the `mlflow` package") from inner
    except ImportError as err:
        assert missing_extra(err) == "mlflow"
    assert missing_extra(ModuleNotFoundError("no x", name="fitdp.nothing")) is None


def test_no_untested_python_fences() -> None:
    bad = [f"{p.relative_to(ROOT)}:{start}: ```{lang}" for p in PAGES
           for lang, start, _ in fenced_blocks(p) if lang in UNTESTED_PYTHON]
    assert not bad, (
        "use ```python (runs in tests/test_docs.py) or ```text (shown, not run) for Python: "
        + ", ".join(bad)
    )


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    missing = [m for m in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python")
               if not _importable(m)]
    if missing:
        pytest.fail(
            f"the docs build needs {', '.join(missing)}, which is not installed. Fix: "
            "pip install -e '.[docs]' (CI: install the docs extra in .ci/run)."
        )
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}{result.stderr}"


def test_readme_example_runs_where_replicas_pay(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (issue 17 item 12): README's first example trained the tiny MLP on
    ["cpu", "cpu"] and, on a busy machine, warned that one replica would train faster. It
    asks for devices="auto" and runs without any FitdpWarning."""
    from fitdp.checks import FitdpWarning

    monkeypatch.chdir(tmp_path)
    readme = ROOT / "README.md"
    with warnings.catch_warnings():
        warnings.simplefilter("error", FitdpWarning)
        exec(compile(page_script(readme), str(readme), "exec"), {"__name__": "docs.README"})


def test_lightning_table_does_not_offer_the_removed_dp_strategy() -> None:
    """docs/keras-lightning.md mapped Lightning's strategy="dp" onto replicas as if it were
    current; Lightning 2.0 removed the "dp" (DataParallel) strategy, so the row says so."""
    page = (ROOT / "docs" / "keras-lightning.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith('| `strategy="dp"`')]
    assert rows and all("removed in Lightning 2.0" in row for row in rows)
