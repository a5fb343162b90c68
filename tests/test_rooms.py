"""The house's rules, read from the code's imports (every import, also inside functions):
no circle between modules, no import from a lower room to a higher one, and the rooms that
alone may talk to a library (docs/ARCHITECTURE.md, "Rules of the house")."""

import ast
import collections
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# A room may import only rooms of a lower floor (and itself). Peers on one floor do not
# import each other: the engine and the trainer know nothing of one another.
FLOORS = {
    "handoff": 0, "errors": 0, "units": 0, "lengths": 0, "varlen": 0, "console": 0,
    "reading": 0.5,   # bounded JSON/YAML reading: above errors, below everything that reads
    "config": 1, "demo_model": 1, "model_files": 1, "safe_files": 1,
    "plan": 2, "dist": 2, "tasks": 2,
    "compile_cache": 2.5,   # torch.compile's persistent cache: the planner's shapes below it
    "memory": 3, "sync": 3, "runplan": 3, "rewards": 3,
    "rollout": 4, "trainer": 4, "modelzoo": 4,
    "calibrate": 5, "run_dir": 5, "loggers": 5, "model_source": 5,
    "export_lora": 5.5,   # a LoRA run's adapter and merge: below export, which calls it
    "switch": 6, "run_report": 6, "preflight": 6, "export": 6,
    "startup": 7,
    "loop": 8,
    "bench": 9, "api": 9,
    "cli": 10,
    "__main__": 11,
}
# Libraries only one room may import.
OWNED = {"torch_memory_saver": "memory", "cuda": "memory"}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in (SRC / "handoff").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = ast.parse(path.read_text(), str(path))
    return out


def _imports(tree: ast.Module, known: set[str]) -> set[str]:
    """Every module name this tree imports (handoff modules resolved to the deepest known)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names
                    if f"{node.module}.{a.name}" in known}
    return out


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _graph():
    modules = _modules()
    known = set(modules)
    return modules, {m: _imports(t, known) for m, t in modules.items()}


def test_every_room_has_a_floor():
    modules, _ = _graph()
    assert {_room(m) for m in modules} <= set(FLOORS), set(map(_room, modules)) - set(FLOORS)


def test_no_import_runs_from_a_lower_room_to_a_higher_one():
    _, graph = _graph()
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                    if b.startswith("handoff") and _room(a) != _room(b)
                    and FLOORS[_room(b)] >= FLOORS[_room(a)])
    assert upward == []


def test_no_circle_between_modules():
    _, graph = _graph()
    inner = {m: {t for t in ts if t in graph and t != m} for m, ts in graph.items()}
    # A package's __init__ importing its own submodules is not a circle.
    inner = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in inner.items()}
    state, circles = collections.defaultdict(int), []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(inner[m]):
            if state[t] == 1:
                circles.append(path[path.index(t):] + [t])
            elif state[t] == 0:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(inner):
        if state[m] == 0:
            visit(m, [m])
    assert circles == []


def test_only_the_owning_room_imports_its_library():
    _, graph = _graph()
    strays = sorted(f"{m} imports {lib}" for m, targets in graph.items() for t in targets
                    for lib, room in OWNED.items()
                    if (t == lib or t.startswith(lib + ".")) and _room(m) != room)
    assert strays == []


def test_the_planner_and_the_config_import_no_torch():
    _, graph = _graph()
    heavy = sorted(f"{m} imports {t}" for m, targets in graph.items() for t in targets
                   if _room(m) in ("plan", "config") and t.split(".")[0] in ("torch", "triton"))
    assert heavy == []
