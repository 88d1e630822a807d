"""The rooms of the package and the arrows between them (docs/architecture.md, "Dependency rules").

Every module's imports are read with ``ast`` (lazy imports inside functions and
type-only imports included, since a cycle hidden behind a lazy import is still a
cycle), resolved to module names, and checked against two rules:

1. arrows only point down: entrypoints -> tools -> engine -> scheduler -> memory ->
   the shared vocabulary at the top of the package, and engine -> model -> kernels;
2. no cycles between modules.

The bookkeeping rooms (memory, scheduler, the vocabulary) also import nothing from
outside the standard library but numpy.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The folders that make up the installed package minipaged (pyproject's package-dir).
SOURCES = {"minipaged": ROOT / "minipaged", "minipaged.model": ROOT / "model", "minipaged.kernels": ROOT / "kernels"}

# room -> the rooms it may import from (besides itself). "facade" is the package's
# __init__ / __main__ and the gpu_check shim: the public names, importing anything.
VOCABULARY = "vocabulary"   # config, sampling_params, outputs, sequence, boot
MAY_IMPORT = {
    "facade": {"entrypoints", "tools", "engine", "scheduler", "memory", VOCABULARY, "model", "kernels"},
    "entrypoints": {"tools", "engine", "scheduler", "memory", VOCABULARY, "model", "kernels"},
    "tools": {"engine", "scheduler", "memory", VOCABULARY, "model", "kernels"},
    "engine": {"scheduler", "memory", VOCABULARY, "model", "kernels"},
    "scheduler": {"memory", VOCABULARY},
    "memory": {VOCABULARY},
    VOCABULARY: set(),
    "model": {"kernels"},
    "kernels": set(),
}
BOOKKEEPING = ("memory", "scheduler", VOCABULARY)
FACADE = {"minipaged", "minipaged.__main__", "minipaged.gpu_check"}


def module_files() -> dict[str, Path]:
    modules = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts or (package == "minipaged" and path.relative_to(folder).parts[0]
                                               in ("model", "kernels")):   # links made by gpu_check.sh
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


MODULES = module_files()


def room(module: str) -> str:
    if module in FACADE:
        return "facade"
    first = module.split(".")[1]          # minipaged.<first>...
    return first if first in MAY_IMPORT else VOCABULARY   # else a module at the top of the package


def imports_of(module: str) -> tuple[set[str], set[str]]:
    """(minipaged modules, outside top-level packages) that ``module`` imports anywhere in it."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    inside, outside = set(), set()

    def add(name: str) -> None:
        if name == "minipaged" or name.startswith("minipaged."):
            while name not in MODULES:       # an attribute of a module: the module itself
                name = name.rsplit(".", 1)[0]
            inside.add(name)
        else:
            outside.add(name.split(".")[0])

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            if node.module == "__future__":
                continue
            for alias in node.names:   # "from pkg import submodule" imports the submodule
                sub = f"{target}.{alias.name}"
                add(sub if sub in MODULES else target)
    inside.discard(module)
    return inside, outside


GRAPH = {m: imports_of(m)[0] for m in MODULES}


def test_the_rooms_are_there():
    rooms = {room(m) for m in MODULES}
    assert rooms == set(MAY_IMPORT), f"rooms found: {sorted(rooms)}"
    for name in ("memory", "scheduler", "engine", "entrypoints", "tools"):
        init = ROOT / "minipaged" / name / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        listed = {p.stem for p in init.parent.glob("*.py") if p.stem != "__init__"}
        missing = sorted(m for m in listed if f"{m}.py" not in doc)
        assert not missing, f"minipaged/{name}/__init__.py's docstring does not list {missing}"


def test_arrows_only_point_down():
    upward = []
    for module, targets in GRAPH.items():
        for target in targets:
            a, b = room(module), room(target)
            if a != b and b not in MAY_IMPORT[a]:
                upward.append(f"{module} ({a}) imports {target} ({b})")
    assert not upward, "imports that point up or sideways:\n  " + "\n  ".join(sorted(upward))


def find_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Depth-first search; every back edge closes a cycle, returned as "a -> b -> a"."""
    state: dict[str, int] = {}       # 1 = on the current path, 2 = done
    path: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return cycles


def test_no_import_cycles():
    cycles = find_cycles(GRAPH)
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_the_checker_finds_a_cycle():
    # the circle this layout broke: cli -> bench -> cli (engine_kwargs)
    graph = {"cli": {"bench", "chat"}, "bench": {"cli"}, "chat": set()}
    assert find_cycles(graph) == ["bench -> cli -> bench"]


def test_bookkeeping_imports_only_the_standard_library_and_numpy():
    allowed = set(sys.stdlib_module_names) | {"numpy"}
    bad = []
    for module in MODULES:
        if room(module) in BOOKKEEPING:
            extra = imports_of(module)[1] - allowed
            if extra:
                bad.append(f"{module} imports {sorted(extra)}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("source, expected", [
    # the checker itself: an upward lazy import and a cycle are both caught
    ("def f():\n    from ..engine.llm_engine import LLMEngine\n", "minipaged.engine.llm_engine"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..engine import beam_search\n",
     "minipaged.engine.beam_search"),
])
def test_the_checker_sees_lazy_and_type_only_imports(tmp_path, monkeypatch, source, expected):
    fake = tmp_path / "fake.py"
    fake.write_text(source)
    monkeypatch.setitem(MODULES, "minipaged.memory.fake", fake)
    inside, _ = imports_of("minipaged.memory.fake")
    assert expected in inside
    assert room(expected) not in MAY_IMPORT[room("minipaged.memory.fake")]


def test_the_public_api_is_unchanged():
    import minipaged

    for name in ("LLM", "LLMEngine", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
                 "OutputKind", "RequestError", "BeamSearchOutput", "BeamSearchSequence"):
        assert name in minipaged.__all__ and hasattr(minipaged, name), name
