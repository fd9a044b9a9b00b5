"""The docs run as written: every ```python block, and a strict MkDocs build.

Convention for docs/*.md and README.md: a ```python block runs. The blocks of one page are
one script (in order, so later blocks use earlier names), run in a fresh namespace in a
temporary working directory. Code that must not run here (GPU only, servers, torchrun) goes in
```text or ```bash blocks. Other spellings of Python fences (```py, ```pycon, ...) are refused,
so no snippet silently escapes the test.

What a statement writes to stdout (a ``print(...)``, ``model.summary()``, a ``fit`` whose
progress bar or callback prints) is shown in the ``#`` lines right under the statement's last
line, ``# `` removed, one comment line per output line. The test compares them with what the
statement wrote (all of it: a print in a loop, a callback's prints during the fit) under
doctest's ELLIPSIS and NORMALIZE_WHITESPACE, so ``...`` stands for a part that varies by
machine or run (a time, a path, a measured load). Under a print statement they must match (a
print that never ran fails); under another statement that wrote nothing they are prose. So a
prose comment about a statement that writes goes at the end of its line or after a blank
line, never right under it.
"""

from __future__ import annotations

import ast
import doctest
import importlib.util
import logging
import re
import subprocess
import sys
import warnings
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

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


OUTPUT_LINE = re.compile(r"^[ \t]*#(?: (?P<text>.*))?$")  # "# text", or "#" for an empty line
Lines = tuple[int, int]  # a statement's first and last line


def statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The simple statements of top-level code (inside if/for/try/with too, not in a def or
    class body): the ones whose output a page shows under them."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        inner = [getattr(node, f, []) for f in ("body", "orelse", "finalbody")]
        inner += [handler.body for handler in getattr(node, "handlers", [])]
        inner += [case.body for case in getattr(node, "cases", [])]
        if any(inner):
            for block in inner:
                yield from statements(block)
        else:
            yield node


def is_print(node: ast.stmt) -> bool:
    call = node.value if isinstance(node, ast.Expr) else None
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
            and call.func.id == "print")


def shown_outputs(script: str) -> dict[Lines, tuple[bool, str]]:
    """What the script shows its statements write: the ``#`` lines right under a statement's
    last line, ``# `` removed, keyed by its lines, with whether it is a print statement."""
    lines, shown = script.splitlines(), {}
    for node in statements(ast.parse(script).body):
        want = []
        for line in lines[node.end_lineno or node.lineno:]:
            m = OUTPUT_LINE.match(line)
            if m is None:
                break
            want.append((m["text"] or "") + "\n")
        if want:
            shown[node.lineno, node.end_lineno or node.lineno] = (is_print(node), "".join(want))
    return shown


class PageStdout:
    """``sys.stdout`` while a page runs: writes through, and keeps what was written while each
    line of the page's top-level code ran (the line its module frame is at: a print in a
    callback counts for the ``fit`` that called it; a write from another thread, for none)."""

    def __init__(self, stream: TextIO, filename: str) -> None:
        self.stream, self.filename = stream, filename
        self.written: dict[int, list[str]] = defaultdict(list)

    def write(self, text: str) -> int:
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename != self.filename
                                     or frame.f_code.co_name != "<module>"):
            frame = frame.f_back
        if frame is not None:
            self.written[frame.f_lineno].append(text)
        return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, encoding, ...: the stream's
        return getattr(self.stream, name)


def wrong_outputs(script: str, written: dict[int, list[str]], page: str) -> list[str]:
    """Where a statement wrote other than what the script shows under it. The lines under a
    statement that wrote nothing are prose, unless it is a print statement."""
    checker, wrong = doctest.OutputChecker(), []
    for (first, last), (must, want) in sorted(shown_outputs(script).items()):
        got = "".join(text for line in range(first, last + 1) for text in written.get(line, []))
        if (got or must) and not checker.check_output(
                want, got, doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE):
            wrong.append(f"{page}:{first}: the page shows\n{want}but it wrote\n"
                         f"{got or '(nothing)'}")
    return wrong


def run_page(page: Path, name: str) -> list[str]:
    """Run the page's python blocks as one script (module ``name``); where what a statement
    wrote differs from what the page shows under it."""
    script = page_script(page)
    code = compile(script, str(page), "exec")  # tracebacks point into the page
    stdout = sys.stdout
    out = PageStdout(stdout, str(page))
    sys.stdout = out  # type: ignore[assignment]  # it writes through to the stdout it holds
    try:
        exec(code, {"__name__": name})
    finally:
        sys.stdout = stdout
    return wrong_outputs(script, out.written,
                         str(page.relative_to(ROOT) if page.is_relative_to(ROOT) else page))


def _has_python(page: Path) -> bool:
    return any(lang == "python" for lang, _, _ in fenced_blocks(page))


@pytest.mark.parametrize("page", [p for p in PAGES if _has_python(p)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # files the snippets write land here
    threads, root = torch.get_num_threads(), logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    torch.set_num_threads(1)  # tiny models: one thread each is fastest, and CI cores are shared
    try:
        wrong = run_page(page, f"docs.{page.stem}")  # not "__main__": servers stay off
    except ImportError as err:
        missing = missing_extra(err)
        if missing is None:
            raise
        pytest.skip(f"{page.name} needs the optional {missing!r}, which is not installed")
    finally:
        torch.set_num_threads(threads)
        root.setLevel(level)
        root.handlers[:] = handlers
    assert not wrong, "\n\n".join(wrong)


PAGE = """# A page

```python
def call(hook):
    hook()


print(1 + 1)
# 2
for i in range(2):
    print(i)
# 0
# 1
print("took 0.123s")
# took ...s
call(lambda: print("from a callback"))
# from a callback
x = 3
# prose: a statement that writes nothing
if x > 5:
    print("never")
# never
print("wrong")
# right
```
"""


def test_a_page_shows_what_its_statements_write(tmp_path: Path) -> None:
    """Regression: the ``#`` outputs under a page's prints were never compared with what they
    printed, so a page showing a false output passed. Now a wrong output and a print that
    never ran fail; ``...``, a print in a loop and a callback's print under the call pass,
    and the lines under a statement that writes nothing are prose."""
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    lines = PAGE.splitlines()
    wrong = run_page(page, "docs.page")
    assert [w.split(": the page shows")[0] for w in wrong] == [
        f"{page}:{lines.index(line) + 1}" for line in ('    print("never")', 'print("wrong")')]
    assert wrong[0].endswith("but it wrote\n(nothing)")
    assert "right\nbut it wrote\nwrong" in wrong[1]


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
