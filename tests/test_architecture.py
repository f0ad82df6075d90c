"""The house rules of ``ferrompi/``, checked on its source (docs/architecture.md).

* Strict layers: no import circle among ferrompi's modules, counting the
  imports inside functions too; an import inside a function (lazy: an
  optional dependency, or the pytest plugin's) says why on its line or the
  line above it (or above its block of imports).
* No module over 1,200 lines.
* The package face is written once: ``ferrompi/__init__.pyi`` names the
  modules whose ``__all__`` make ``ferrompi.__all__``; the face has no name
  twice, every name resolves, and a type checker (mypy) sees it.
* ``py.typed`` ships, so that type checkers read ferrompi's annotations.
"""

from __future__ import annotations

import ast
import importlib
import os
import pathlib
import re
import subprocess
import sys

import ferrompi

PACKAGE = pathlib.Path(ferrompi.__file__).resolve().parent
ROOT = PACKAGE.parent
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_LINES = 1200


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


NAMES = {module_name(p): p for p in MODULES}


def resolve(importer: str, is_package: bool, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The ferrompi modules an import statement of module ``importer`` loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "ferrompi"]
    if node.level == 0:
        base = node.module or ""
        if base.split(".")[0] != "ferrompi":
            return []
    else:
        package = importer.split(".") if is_package else importer.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    found = []
    for alias in node.names:  # `from . import x` may name a submodule
        candidate = f"{base}.{alias.name}"
        found.append(candidate if candidate in NAMES else base)
    return found


def imports(path: pathlib.Path) -> list[tuple[str, ast.stmt, bool]]:
    """``(imported ferrompi module, statement, inside a function)`` of every import of ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    name = module_name(path)
    is_package = path.name == "__init__.py"
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                for target in resolve(name, is_package, child):
                    found.append((target, child, in_function))
                if in_function and not resolve(name, is_package, child):
                    found.append(("", child, in_function))  # a lazy third-party import
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            visit(child, inner)

    visit(tree, False)
    return found


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in NAMES}
    for path in MODULES:
        importer = module_name(path)
        for target, _, _ in imports(path):
            if target and target != importer and target in NAMES:
                edges[importer].add(target)
    # a module's import runs its package's __init__ first: not an edge of the
    # layering (ferrompi/__init__.py imports nothing of its own at import time)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def test_no_import_circles():
    assert circles(graph()) == []


def test_the_circle_check_finds_a_circle():
    # the check itself, on a made-up graph: a -> b -> c -> a, and d -> a
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(edges) == [["a", "b", "c"]]
    # and the graph counts imports inside functions (the plugin's are all there)
    assert "ferrompi.backend" in graph()["ferrompi.pytest_plugin"]


def test_every_import_inside_a_function_says_why_it_is_lazy():
    unexplained = []
    for path in MODULES:
        lines = path.read_text(encoding="utf-8").splitlines()
        for _, node, in_function in imports(path):
            if not in_function:
                continue
            here, i = lines[node.lineno - 1], node.lineno - 2
            while i >= 0 and lines[i].strip().startswith(("import ", "from ")):
                i -= 1  # a block of imports under one comment
            if "#" not in here and not lines[i].strip().startswith("#"):
                unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno}: {here.strip()}")
    assert not unexplained, "imports inside functions without a comment saying why:\n" + "\n".join(
        sorted(set(unexplained))
    )


def test_no_module_is_over_the_line_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for p in MODULES
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


# ---------------------------------------------------------------------------
# the package face
# ---------------------------------------------------------------------------

STUB = PACKAGE / "__init__.pyi"
FACE_LINE = re.compile(r"^from \.(\w+) import (\*|.+)$")


def face_lines() -> list[tuple[str, list[str] | None]]:
    """``(module, names or None for *)`` of each import line of ``__init__.pyi``."""
    found = []
    for line in STUB.read_text(encoding="utf-8").splitlines():
        m = FACE_LINE.match(line)
        if m:
            names = (
                None if m.group(2) == "*" else [a.split(" as ")[0] for a in m.group(2).split(",")]
            )
            found.append((m.group(1), names))
    return found


def test_the_face_is_each_module_s_all_written_once():
    expected: list[str] = []
    for module, names in face_lines():
        mod = importlib.import_module(f"ferrompi.{module}")
        if names is None:
            names = list(mod.__all__)
        for name in names:
            assert hasattr(mod, name), f"ferrompi.{module} has no {name}"
        expected.extend(names)
    assert list(ferrompi.__all__) == expected
    twice = sorted({n for n in expected if expected.count(n) > 1})
    assert not twice, f"in the face more than once: {twice}"
    for name in ferrompi.__all__:
        assert getattr(ferrompi, name) is not None
    assert set(ferrompi.__all__) <= set(dir(ferrompi))


def test_the_face_is_read_without_importing_the_modules():
    # a fresh interpreter: reading the face loads neither MPI nor h5py
    code = (
        "import sys, ferrompi\n"
        "names = ferrompi.__all__\n"
        "assert 'allreduce' in names and 'save_distributed' in names, names\n"
        "loaded = [m for m in ('mpi4py.MPI', 'h5py', 'ferrompi.collectives') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_py_typed_ships():
    assert (PACKAGE / "py.typed").is_file()
    setup = (ROOT / "setup.cfg").read_text(encoding="utf-8")
    assert re.search(r"^ferrompi = .*\bpy\.typed\b.*\b__init__\.pyi\b", setup, re.M)


FACE_SAMPLES = {  # name in the face -> the start of the type mypy must reveal
    "fm.allreduce": "def (x: ",
    "fm.all_to_all_single_uneven": "def (x: ",
    "fm.DTensor": "def (local: ",
    "fm.Shard": "def (dim: ",
    "fm.save_distributed": "def (state_dict: ",
    "fm.cuda_aware": "def () -> bool",
    "fm.LaunchInfo": "def (launcher: ",
    "fm.gpu.set_cuda_aware": "def (value: ",
}


def test_a_type_checker_sees_the_face(tmp_path):
    lines = ["import ferrompi as fm", *(f"reveal_type({name})" for name in FACE_SAMPLES)]
    lines.append("fm.no_such_name")
    script = tmp_path / "uses_the_face.py"
    script.write_text("\n".join(lines) + "\n", encoding="utf-8")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--follow-imports=silent",
            "--no-incremental",
            "--cache-dir",
            str(tmp_path / "cache"),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={
            **os.environ,
            "MYPYPATH": str(ROOT),
        },  # this checkout (an editable install is a finder)
    )
    revealed = {}
    for line in proc.stdout.splitlines():
        m = re.match(r".*?:(\d+): note: Revealed type is \"(.*)\"$", line)
        if m:
            revealed[lines[int(m.group(1)) - 1][len("reveal_type(") : -1]] = m.group(2)
    for name, start in FACE_SAMPLES.items():
        assert revealed.get(name, "").startswith(start), (
            f"{name}: {revealed.get(name)}\n{proc.stdout}"
        )
    # the one name that is not in the face is an error, so the others were found
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and '"no_such_name"' in errors[0], proc.stdout
