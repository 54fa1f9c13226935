"""Imports run one way: server -> router -> workers -> engine / kvtransfer -> shared
leaves (fp8, host_memory, memory, security); the offline tools (pdserve.offline) sit beside the
serving path, built on the engine, and nothing that serves requests imports them. Every module under pdserve/ is parsed (no import is
executed) and each ``pdserve.*`` import, at any depth in the module, is checked against the
packages its layer may not use."""

from __future__ import annotations

import ast
from pathlib import Path

import pdserve

ROOT = Path(pdserve.__file__).parent
WORKERS = ("pdserve.decode_worker", "pdserve.prefill_worker", "pdserve.worker_base",
           "pdserve.worker_metrics")
ENTRY = ("pdserve.cli", "pdserve.launcher", "pdserve.cluster", "pdserve.benchmark")
#: offline tools (EAGLE training, quantized-checkpoint authoring): only the CLI runs them
OFFLINE = ("pdserve.offline",)

#: package prefix -> prefixes it must not import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "pdserve.engine": (*OFFLINE, "pdserve.server", "pdserve.router", "pdserve.kvtransfer",
                       "pdserve.messages", "pdserve.security", *WORKERS, *ENTRY),
    "pdserve.kvtransfer": (*OFFLINE, "pdserve.engine", "pdserve.server", "pdserve.router",
                           "pdserve.messages", *WORKERS, *ENTRY),
    "pdserve.fp8": ("pdserve.engine", "pdserve.kvtransfer", "pdserve.server",
                    "pdserve.router", *WORKERS, *ENTRY),
    "pdserve.host_memory": ("pdserve.engine", "pdserve.kvtransfer", *WORKERS, *ENTRY),
    "pdserve.memory": ("pdserve.engine", "pdserve.kvtransfer", "pdserve.server",
                       "pdserve.router", *WORKERS, *ENTRY),
    "pdserve.security": ("pdserve.engine", "pdserve.kvtransfer", "pdserve.server",
                         "pdserve.router", *WORKERS, *ENTRY),
    "pdserve.decode_worker": (*OFFLINE, "pdserve.prefill_worker", "pdserve.server",
                              "pdserve.router", *ENTRY),
    "pdserve.prefill_worker": (*OFFLINE, "pdserve.decode_worker", "pdserve.server",
                               "pdserve.router", *ENTRY),
    "pdserve.router": (*OFFLINE, "pdserve.server", *WORKERS, *ENTRY),
    "pdserve.server": (*OFFLINE, *WORKERS, *ENTRY),
    "pdserve.worker_base": OFFLINE,
    "pdserve.launcher": OFFLINE,
    "pdserve.offline": ("pdserve.server", "pdserve.router", *WORKERS, "pdserve.launcher"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) of every absolute ``pdserve`` import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name.startswith("pdserve")]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_no_import_goes_against_the_layering():
    violations = []
    for path in sorted(ROOT.rglob("*.py")):
        module = module_name(path)
        rules = [bad for pkg, bad in FORBIDDEN.items() if _under(module, pkg)]
        for line, name in imports_of(path):
            for bad in (b for rule in rules for b in rule):
                if _under(name, bad):
                    violations.append(f"{path.relative_to(ROOT.parent)}:{line} imports {name}")
    assert not violations, "\n".join(violations)


def test_the_checker_sees_a_wrong_way_import(tmp_path):
    """The parser finds imports inside functions too (a lazy import is still a dependency)."""
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from pdserve.server.app import build_app\n")
    assert imports_of(bad) == [(2, "pdserve.server.app")]


def top_level_imports(path: Path) -> set[str]:
    """``pdserve`` modules imported when ``path`` is imported (module-level statements,
    including those under ``if``/``try``; ``from a import b`` names ``a.b`` when that is a
    module)."""
    found: set[str] = set()

    def visit(body) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if _module_path(sub) is not None else node.module)
            elif isinstance(node, (ast.If, ast.Try)):
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    continue
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
    visit(ast.parse(path.read_text(), str(path)).body)
    return {name for name in found if name.startswith("pdserve")}


def _module_path(name: str) -> Path | None:
    base = ROOT.parent.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def find_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every back edge of a depth-first walk of ``graph``, as ``a -> b -> a``."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    cycles = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                walk(nxt, stack + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    return cycles


def test_no_import_cycles_at_import_time():
    graph = {module_name(p): top_level_imports(p) for p in ROOT.rglob("*.py")}
    assert find_cycles(graph) == []
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a -> b -> c -> a"]
