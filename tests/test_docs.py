"""The documentation's examples run, and the API page covers the public names.

* Every ``pycon`` block of every ``docs/*.md`` page is a doctest (run with
  ELLIPSIS and NORMALIZE_WHITESPACE, one namespace per page, line numbers of
  the page). A ``>>>`` outside a ``pycon`` block is an error: it would not run.
* Every ``python`` block is a script. A block whose first line is a comment
  naming a file (``# script.py``) is written under that name, so that a test
  file (``# test_script.py``) on the same page can import it. Scripts run as
  an MPI job of 2 ranks when the ``mpiexec`` next to this Python exists (the
  ``mpich`` extra), else as one process; ``test_*.py`` files run under pytest.
* Every docstring example of every ferrompi module runs.
* ``docs/api.md`` documents exactly ``ferrompi.__all__``, and the pages
  name every other name of a public module's ``__all__``.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import os
import pathlib
import pkgutil
import re
import subprocess
import sys
import tempfile

import pytest

import ferrompi

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([^\s`]*)")
FILE_COMMENT = re.compile(r"^#\s*([\w.-]+\.py)\s*$")
MPIEXEC = pathlib.Path(sys.executable).with_name("mpiexec")


def fenced_blocks(path: pathlib.Path) -> list[tuple[str, int, list[str]]]:
    """``(language, first content line number, lines)`` of each fenced block."""
    blocks = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(1), m.group(2)
        start = i + 1
        i = start
        while i < len(lines) and lines[i].strip() != fence:
            i += 1
        if i == len(lines):
            raise AssertionError(f"{path.name}:{start}: unclosed code fence")
        blocks.append((lang, start + 1, lines[start:i]))
        i += 1
    return blocks


def page_id(path: pathlib.Path) -> str:
    return path.name


def run_doctest(test: doctest.DocTest) -> None:
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report: list[str] = []
    runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)


# ---------------------------------------------------------------------------
# docs/*.md
# ---------------------------------------------------------------------------


def test_pages_exist():
    names = {p.name for p in PAGES}
    for required in (
        "index.md",
        "install.md",
        "quickstart.md",
        "collectives.md",
        "timeouts.md",
        "errors.md",
        "api.md",
    ):
        assert required in names


@pytest.fixture
def temp_files_under_tmp_path(tmp_path, monkeypatch):
    """The examples' ``tempfile.mkdtemp()`` folders go under pytest's ``tmp_path``.

    pytest removes those with the runs it no longer keeps; the examples
    themselves do not clean up, as a reader's session would not.
    """
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def _uses_torch(lines: list[str]) -> bool:
    """Whether a block of a page imports torch (an optional dependency)."""
    return any(re.match(r"\s*(>>> )?(import|from) torch\b", line) for line in lines)


@pytest.mark.usefixtures("temp_files_under_tmp_path")
@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_page_doctests(page):
    """The page's ``pycon`` blocks, as one doctest with the page's line numbers."""
    if any(lang == "pycon" and _uses_torch(lines) for lang, _, lines in fenced_blocks(page)):
        pytest.importorskip("torch", reason="the page's examples use torch (not installed)")
    n_lines = len(page.read_text(encoding="utf-8").splitlines())
    text = [""] * n_lines
    for lang, first, lines in fenced_blocks(page):
        if lang == "pycon":
            text[first - 1 : first - 1 + len(lines)] = lines
        else:
            assert not any(line.lstrip().startswith(">>>") for line in lines), (
                f"{page.name}:{first}: '>>>' in a {lang or 'plain'} block; use ```pycon"
            )
    source = "\n".join(text) + "\n"
    test = doctest.DocTestParser().get_doctest(source, {}, page.name, str(page), 0)
    if test.examples:
        run_doctest(test)


def _scripts(page: pathlib.Path) -> list[tuple[str, int, str]]:
    scripts = []
    for lang, first, lines in fenced_blocks(page):
        if lang != "python":
            continue
        m = FILE_COMMENT.match(lines[0]) if lines else None
        name = m.group(1) if m else f"block_{first}.py"
        scripts.append((name, first, "\n".join(lines) + "\n"))
    return scripts


SCRIPT_PAGES = [p for p in PAGES if _scripts(p)]


@pytest.mark.parametrize("page", SCRIPT_PAGES, ids=page_id)
def test_page_scripts(page, tmp_path):
    """The page's ``python`` blocks run as scripts (and ``test_*.py`` under pytest)."""
    scripts = _scripts(page)
    for name, _, code in scripts:
        (tmp_path / name).write_text(code, encoding="utf-8")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["MPIEXEC_TIMEOUT"] = "240"  # mpiexec (hydra) ends a hung job
    for name, first, code in scripts:
        if _uses_torch(code.splitlines()) and importlib.util.find_spec("torch") is None:
            continue  # the page's numpy scripts still run; torch's need torch
        if name.startswith("test_"):
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name]
        elif MPIEXEC.exists():
            cmd = [str(MPIEXEC), "-n", "2", sys.executable, name]
        else:
            cmd = [sys.executable, name]
        proc = subprocess.run(
            cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, (
            f"{page.name}:{first} ({name}): {' '.join(cmd)} exited with {proc.returncode}\n"
            f"{proc.stdout}\n{proc.stderr}"
        )


# ---------------------------------------------------------------------------
# docstrings
# ---------------------------------------------------------------------------


#: Modules that need an optional package, by the package's name.
NEEDS = {"ferrompi.torch": "torch"}


def _modules() -> list[str]:
    """ferrompi's modules, without those whose optional package is not installed."""
    names = ["ferrompi"]
    for info in pkgutil.walk_packages(ferrompi.__path__, "ferrompi."):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue
        needs = NEEDS.get(info.name)
        if needs is None or importlib.util.find_spec(needs) is not None:
            names.append(info.name)
    return sorted(names)


@pytest.mark.usefixtures("temp_files_under_tmp_path")
@pytest.mark.parametrize("name", _modules())
def test_module_doctests(name):
    """``doctest.testmod`` of one ferrompi module."""
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder().find(module, name)
    for test in sorted(tests, key=lambda t: t.name):
        if test.examples:
            run_doctest(test)


def test_package_has_docstring_examples():
    count = 0
    for name in _modules():
        module = importlib.import_module(name)
        count += sum(len(t.examples) for t in doctest.DocTestFinder().find(module, name))
    assert count > 0


# ---------------------------------------------------------------------------
# the API page
# ---------------------------------------------------------------------------

API_ENTRY = re.compile(
    r"^\.\. (?:auto(?:function|class|exception|data)|py:data)::\s+ferrompi\.(\w+)\s*$", re.M
)


def test_api_page_documents_every_public_name():
    documented = API_ENTRY.findall((DOCS / "api.md").read_text(encoding="utf-8"))
    missing = [n for n in ferrompi.__all__ if n not in documented]
    assert not missing, f"docs/api.md does not document: {missing}"
    extra = [n for n in documented if n not in ferrompi.__all__]
    assert not extra, f"docs/api.md documents names not in ferrompi.__all__: {extra}"
    twice = sorted({n for n in documented if documented.count(n) > 1})
    assert not twice, f"docs/api.md documents these more than once: {twice}"


def test_public_names_exist():
    for name in ferrompi.__all__:
        assert hasattr(ferrompi, name), name


def test_every_public_module_s_names_are_in_the_docs():
    # beyond the package face (above): the names of public submodules such as
    # ferrompi.gpu, ferrompi.parallel, ferrompi.rpc, ferrompi.typing
    text = "\n".join(page.read_text(encoding="utf-8") for page in PAGES)
    missing = []
    for name in _modules():
        if any(part.startswith("_") for part in name.split(".")[1:]):
            continue
        for public in getattr(importlib.import_module(name), "__all__", ()):
            if not re.search(rf"\b{re.escape(public)}\b", text):
                missing.append(f"{name}.{public}")
    assert not missing, f"not named in docs/*.md: {missing}"
