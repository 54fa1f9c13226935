"""The size and documentation limits the codebase keeps (STYLE.md, "Our habits" 1 and 4):
every module under ``pdserve/`` is parsed (nothing is imported) and measured.

- no file over :data:`MAX_FILE_LINES` lines and no function over :data:`MAX_FUNCTION_LINES`
  (``def`` through its last line, docstring included);
- every public class, function and method (no leading underscore, inside a public class;
  dunders exempt) has a docstring;
- the engine core (``engine/*.py`` plus ``attention/``, ``layers/``, ``models/``: the path
  a request's tokens take) stays under :data:`MAX_ENGINE_CORE_LINES`;
- ``engine/`` holds serving code only: no optimizer, no backward pass (training and
  quantization authoring live in ``pdserve/offline``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pdserve

ROOT = Path(pdserve.__file__).parent
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_ENGINE_CORE_LINES = 3500
ENGINE_CORE = ("engine/*.py", "engine/attention/*.py", "engine/layers/*.py",
               "engine/models/*.py")
#: what only training code does
TRAINING_ONLY = re.compile(r"torch\.optim\b|\.backward\(|\bautograd\.grad\(")


def modules() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def num_lines(path: Path) -> int:
    return path.read_text().count("\n")


def public_defs(tree: ast.Module):
    """(node, qualified name) of every public class/function/method, depth first."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if child.name.startswith("_"):
                continue
            yield child, prefix + child.name
            if isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
    yield from walk(tree, "")


def all_defs(tree: ast.Module):
    """Every function or method (nested ones included)."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_file_is_over_the_line_limit():
    too_long = {str(p.relative_to(ROOT)): n for p in modules()
                if (n := num_lines(p)) > MAX_FILE_LINES}
    assert too_long == {}


def test_no_function_is_over_the_line_limit():
    too_long = []
    for path in modules():
        for node in all_defs(ast.parse(path.read_text())):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length})")
    assert too_long == []


def test_every_public_definition_has_a_docstring():
    missing = []
    for path in modules():
        for node, name in public_defs(ast.parse(path.read_text())):
            if ast.get_docstring(node) is None:
                missing.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert missing == []


def test_engine_core_stays_small():
    files = {p for pattern in ENGINE_CORE for p in ROOT.glob(pattern)}
    assert len(files) > 10  # the globs still match the layout
    assert sum(num_lines(p) for p in files) <= MAX_ENGINE_CORE_LINES


def test_engine_holds_no_training_code():
    found = [f"{p.relative_to(ROOT)}:{i + 1}" for p in (ROOT / "engine").rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines()) if TRAINING_ONLY.search(line)]
    assert found == []


def test_the_checks_see_what_they_should():
    """The measures themselves: a long function, a missing docstring and a private def."""
    src = "def public():\n" + "    x = 1\n" * 70 + "class _Hidden:\n    def f(self): pass\n"
    tree = ast.parse(src)
    assert [n.end_lineno - n.lineno + 1 for n in all_defs(tree)][0] == 71
    assert [name for _, name in public_defs(tree)] == ["public"]
    assert TRAINING_ONLY.search("loss.backward()") and not TRAINING_ONLY.search("backward_s")
