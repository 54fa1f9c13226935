"""Imports run one way: server -> router -> workers -> engine / kvtransfer -> shared
leaves (fp8, host_memory, security). Every module under pdserve/ is parsed (no import is
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

#: package prefix -> prefixes it must not import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "pdserve.engine": ("pdserve.server", "pdserve.router", "pdserve.kvtransfer",
                       "pdserve.messages", "pdserve.security", *WORKERS, *ENTRY),
    "pdserve.kvtransfer": ("pdserve.engine", "pdserve.server", "pdserve.router",
                           "pdserve.messages", *WORKERS, *ENTRY),
    "pdserve.fp8": ("pdserve.engine", "pdserve.kvtransfer", "pdserve.server",
                    "pdserve.router", *WORKERS, *ENTRY),
    "pdserve.host_memory": ("pdserve.engine", "pdserve.kvtransfer", *WORKERS, *ENTRY),
    "pdserve.security": ("pdserve.engine", "pdserve.kvtransfer", "pdserve.server",
                         "pdserve.router", *WORKERS, *ENTRY),
    "pdserve.decode_worker": ("pdserve.prefill_worker", "pdserve.server", "pdserve.router",
                              *ENTRY),
    "pdserve.prefill_worker": ("pdserve.decode_worker", "pdserve.server", "pdserve.router",
                               *ENTRY),
    "pdserve.router": ("pdserve.server", *WORKERS, *ENTRY),
    "pdserve.server": (*WORKERS, *ENTRY),
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
