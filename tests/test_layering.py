"""The package's imports run one way: each module imports only from its own layer or the layers below,
and no two modules import each other (directly or around a longer circle), lazy imports included. Imports
under ``if TYPE_CHECKING:`` only name types for annotations and are never run, so they do not count."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_tidar"

# Lowest first. A module's layer is that of its first path component under hf_tidar/.
LAYERS: list[set[str]] = [
    {"_logging", "_quiet", "_warning_stacklevel", "assets", "adapter_format", "cache", "configuration", "losses",
     "masks", "mask_tail", "prompts", "backbones", "prompt_encoding", "dataset_shards"},
    {"kernels", "cpu", "checkpoints"},
    {"adapters"},
    {"generation"},
    {"modeling"},
    {"folders"},
    {"training", "tiny"},
    {"cdlm"},
    {"metrics", "__init__"},
    {"bench", "hub", "demo"},
    {"cli", "__main__", "commands", "exit_codes"},
]


def _layer(component: str) -> int:
    for rank, names in enumerate(LAYERS):
        if component in names:
            return rank
    raise AssertionError(f"hf_tidar/{component} has no layer in tests/test_layering.py: add it where it belongs.")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every ``hf_tidar`` module ``path`` imports, at any depth of the file (lazy imports too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("hf_tidar")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("hf_tidar"):
                found.add(target)
                # ``from . import x`` names modules too
                found |= {f"{target}.{alias.name}" for alias in node.names if _is_module(f"{target}.{alias.name}")}
    return {module for module in found if _is_module(module)} - {name}


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in ast.walk(child))
            continue
        yield node
        yield from _runtime_nodes(node)


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _component(dotted: str) -> str:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_import_reaches_up_a_layer(path):
    own = _layer(_component(_module_name(path)))
    upward = [m for m in _imports(path) if _layer(_component(m)) > own]
    assert not upward, f"{path.relative_to(PACKAGE)} imports {upward}, which sit above it"


def test_no_import_circle():
    graph = {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}
    # A package's __init__ re-exporting its own modules is not a circle: drop edges into a parent package.
    graph = {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in graph.items()}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for target in graph.get(node, ()):
            if state.get(target) == 1:
                raise AssertionError("import circle: " + " -> ".join(trail[trail.index(target):] + [target]))
            if target not in state:
                visit(target, trail + [target])
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """A lower-layer module that imports the CLI is reported (the checker is not blind)."""
    fake = PACKAGE / "masks.py"
    original = _imports

    def with_cli(path):
        return original(path) | ({"hf_tidar.cli"} if path == fake else set())

    monkeypatch.setitem(globals(), "_imports", with_cli)
    with pytest.raises(AssertionError, match="sit above it"):
        test_no_import_reaches_up_a_layer(fake)
