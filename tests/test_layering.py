"""The structure stays as designed: layers import downward only, no import cycles, and nothing
outside ``shared/engine/`` reaches past the ``EngineBackend`` interface into an engine.

Layers, bottom up: ``shared`` (the common library) < ``services`` < ``infra`` (runs them) <
``loadtest`` (drives them). The ``pdd`` entry point, ``infra/cli.py``, is held to its layer like
every module: ``loadtest``'s commands reach it through the ``pdd.commands`` entry points.
"""

import ast
import re
from pathlib import Path

from shared.engine.backend import EngineBackend

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["shared", "services", "infra", "loadtest"]
PUBLIC_ENGINE_MODULES = {"shared.engine.backend", "shared.engine.sampling", "shared.engine.logprobs"}
CONSTRUCTIBLE = {"shared.engine.hf_engine": {"HfEngine", "DEFAULT_MAX_BATCH_TOKENS"}}
ENGINE_PROFILERS = {"loadtest.decode_profile"}
"""Tools that time the HF engine's own pieces (products, gather, sampling) by wrapping them."""
"""Benchmarks and the profiler build the HF engine themselves, then use it as a backend."""


def modules() -> dict[str, Path]:
    found = {}
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every import in the file, in functions too, and of every
    module named by a string ``importlib.import_module`` or ``__import__`` is called with."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and _called(node) in ("import_module", "__import__") and node.args:
            if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.append((node.args[0].value, []))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [alias.name for alias in node.names]
            submodules = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in known]
            found += [(node.module, names)] + [(m, []) for m in submodules]
    return found


def _called(call: ast.Call) -> str:
    return call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")


def graph() -> dict[str, set[str]]:
    known = modules()
    return {
        name: {target for target, _ in imports(path, known) if target in known and target != name}
        for name, path in known.items()
    }


def layer_of(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def test_every_layer_imports_only_layers_below_it():
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in graph().items()
        for target in targets
        if layer_of(target) > layer_of(source)
    )
    assert upward == []


def test_no_import_cycles():
    edges, cycles = graph(), []
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]):
        state[node] = "open"
        for target in sorted(edges[node]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def in_engine_package(module: str) -> bool:
    return module == "shared.engine" or module.startswith("shared.engine.")


def engine_members() -> set[str]:
    return {name for name in dir(EngineBackend) if not name.startswith("_")} | set(EngineBackend.__annotations__)


def engine_bound_names(tree: ast.AST) -> set[str]:
    """Names that hold an engine in this file: ``engine``/``backend`` and what HfEngine(...) or
    create_backend(...) is assigned to."""
    names = {"engine", "backend"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if called in ("HfEngine", "create_backend"):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
                names |= {t.attr for t in node.targets if isinstance(t, ast.Attribute)}
    return names


def test_nothing_outside_the_engine_package_reaches_past_the_backend_interface():
    known, members, misuse = modules(), engine_members(), []
    for name, path in known.items():
        if in_engine_package(name) or name in ENGINE_PROFILERS:
            continue
        engine_imports = [(m, names) for m, names in imports(path, known) if in_engine_package(m)]
        for module, names in engine_imports:
            allowed = CONSTRUCTIBLE.get(module)
            if module not in PUBLIC_ENGINE_MODULES and (allowed is None or not set(names) <= allowed):
                misuse.append(f"{name} imports {module} {names}")
        if not engine_imports and not re.search(r"self\.engine\b", path.read_text()):
            continue
        tree = ast.parse(path.read_text())
        holders = engine_bound_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr not in members:
                base = node.value
                held = (isinstance(base, ast.Name) and base.id in holders) or (
                    isinstance(base, ast.Attribute) and base.attr in holders
                )
                if held:
                    misuse.append(f"{name}:{node.lineno} uses engine member {node.attr!r}")
    assert misuse == []


def doc_file_references() -> list[tuple[str, str]]:
    """(doc, path) for every repository path a doc names outside its code blocks."""
    pattern = re.compile(r"`((?:\.\./)?(?:[\w.-]+/)+[\w.-]+\.(?:py|md|yml|yaml|json|toml|png|sh|conf))`")
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        prose = re.sub(r"```.*?```", "", doc.read_text(), flags=re.DOTALL)
        found += [(str(doc.relative_to(ROOT)), m.group(1)) for m in pattern.finditer(prose)]
    return found


def test_every_doc_refers_only_to_files_in_the_repository():
    refs = doc_file_references()
    assert len(refs) > 50  # the pattern still finds the docs' references
    missing = [
        f"{doc}: {path}"
        for doc, path in refs
        if not (ROOT / path).exists() and not (ROOT / doc).parent.joinpath(path).exists()
    ]
    assert missing == []


def test_no_test_module_imports_another():
    """Shared helpers live in ``tests/helpers.py`` and fixtures in ``conftest.py``: a test file
    can then change without breaking another."""
    test_modules = {p.stem for p in (ROOT / "tests").rglob("test_*.py")}
    crossing = sorted(
        f"{path.relative_to(ROOT)} -> {module}"
        for path in (ROOT / "tests").rglob("*.py")
        for module, names in imports(path, {})
        for target in [module, *(f"{module}.{n}" for n in names)]
        if target.startswith("tests.") and target.split(".")[-1] in test_modules
    )
    assert not crossing, crossing
