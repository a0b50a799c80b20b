"""The package's layout holds what docs/architecture.md says of it (pure checks, milliseconds)."""

import ast
from pathlib import Path

from tests.helpers import REPO

PACKAGE = REPO / "yatt_lightning"
LIBRARY = [PACKAGE, REPO / "callbacks", REPO / "datamodules"]


def _modules(roots=(PACKAGE,)) -> dict[str, Path]:
    """Module name -> file (``callbacks/`` and ``datamodules/`` are installed as ``yatt_lightning.*``)."""
    mods = {}
    for root in roots:
        for f in root.rglob("*.py"):
            parts = list(f.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts if root == PACKAGE else ["yatt_lightning", *parts])] = f
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in it, type-checking imports too; packages'
    ``__init__`` re-exports left out, as the project check does)."""
    edges = {m: set() for m in mods}
    for m, f in mods.items():
        pkg = m if f.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            edges[m].update(x for x in names if x in mods and x != m and mods[x].name != "__init__.py")
    return edges


def test_no_modules_import_each_other_directly_or_in_a_ring():
    edges = _imports(_modules())
    index, low, stack, on_stack, rings, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            ring = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                ring.append(w)
                if w == v:
                    break
            if len(ring) > 1:
                rings.append(sorted(ring))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert rings == [], f"modules that import each other (one should hand the other a value): {rings}"


def test_no_folders_import_each_other_in_a_ring():
    """Folders (and the root's modules) form layers: no import, at module level or inside a function, goes
    from one folder into another that imports back, directly or around a ring (issue 42: one tangle had
    joined 13 of them)."""

    def unit(module: str) -> str:
        return ".".join(module.split(".")[:2])

    edges: dict[str, set[str]] = {}
    for a, targets in _imports(_modules(tuple(LIBRARY))).items():
        edges.setdefault(unit(a), set()).update(unit(b) for b in targets if unit(b) != unit(a))
    reach = {u: set(v) for u, v in edges.items()}
    changed = True
    while changed:  # the transitive closure: a unit that reaches itself is in a ring
        changed = False
        for seen in reach.values():
            more = set().union(*(reach.get(v, set()) for v in seen)) - seen
            if more:
                seen |= more
                changed = True
    ringed = sorted(u for u, seen in reach.items() if u in seen)
    paths = {u: sorted(v for v in edges[u] if u in reach.get(v, set())) for u in ringed}
    assert ringed == [], f"folders in an import ring (each with the folders it imports that lead back): {paths}"


def test_the_package_root_shows_the_architecture():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 12, root
    for folder in ("run", "rollout", "placement", "training", "checkpoint", "distributed", "multimodal"):
        assert (PACKAGE / folder / "__init__.py").exists(), folder


def test_no_library_file_is_over_400_lines():
    long = {str(f.relative_to(REPO)): n for d in LIBRARY for f in d.rglob("*.py")
            if (n := len(f.read_text().splitlines())) > 400}  # fmt: skip
    assert long == {}


def test_nothing_below_the_service_calls_back_up_and_no_step_figure_lives_in_an_attribute():
    below = [*(PACKAGE / "placement").glob("*.py"), PACKAGE / "rollout" / "controller.py",
             PACKAGE / "rollout" / "longtail.py"]  # fmt: skip
    calls_up = []
    for f in below:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.arg) and node.arg in ("service", "strategy"):
                calls_up.append(f"{f.name}:{node.lineno} parameter {node.arg}")
            if isinstance(node, ast.Attribute) and node.attr in ("service", "strategy", "setup"):
                calls_up.append(f"{f.name}:{node.lineno} .{node.attr}")
    assert calls_up == []
    holders = ("phase_times", "reward_metrics", "sync_seconds", "judged", "idle", "memory")
    kept = []
    for f in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr in holders and getattr(t.value, "id", "") == "self":
                    kept.append(f"{f.relative_to(PACKAGE)}:{node.lineno} self.{t.attr}")
    assert kept == []


def test_no_rank_is_dispatched_on_a_role_string():
    """What a rank does is asked of its typed role (``placement/role.py``: ``trains``, ``split``, ...), never by
    comparing a string: 23 such tests in 6 files had drifted apart (issue 42)."""

    def named_role(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "role") or (isinstance(node, ast.Attribute) and node.attr == "role")

    found = []
    for f in (f for d in LIBRARY for f in d.rglob("*.py") if f.name != "role.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                strings = [s for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
                strings += [e for s in sides if isinstance(s, ast.Tuple | ast.List | ast.Set) for e in s.elts
                            if isinstance(e, ast.Constant)]  # fmt: skip
                if strings and any(named_role(s) for s in sides):
                    found.append(f"{f.relative_to(REPO)}:{node.lineno}")
    assert found == []


def test_the_engine_class_path_configs_already_name_still_resolves():
    """``engines/`` left ``rollout/`` (issue 42); a user's config naming ``yatt_lightning.rollout.vllm_engine.VLLMEngine``
    keeps working (the same class)."""
    from yatt_lightning.engines.vllm_engine import VLLMEngine
    from yatt_lightning.rollout.vllm_engine import VLLMEngine as Old

    assert Old is VLLMEngine
