"""The package's layers hold: the import-linter contracts catch an upward import, the package graph has no
cycle, and the OpenAI door and the launcher run without torch."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _copy_tree(target: Path) -> None:
    """The runtime and benchmark packages under their import names, and the contracts, in ``target``."""
    ignore = shutil.ignore_patterns("__pycache__", "default_model", "*.c", "*.h")
    shutil.copytree(ROOT / "backend", target / "pagedllm", ignore=ignore)
    shutil.copytree(ROOT / "benchmarks", target / "pagedllm_bench", ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", target / "pyproject.toml")


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT_IMPORTS), "--config", str(tree / "pyproject.toml"), "--no-cache"], cwd=tree,
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_contracts_hold_and_an_upward_import_breaks_them(tmp_path: Path) -> None:
    _copy_tree(tmp_path)
    clean = _lint_imports(tmp_path)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "0 broken" in clean.stdout

    (tmp_path / "pagedllm" / "core" / "upward.py").write_text("from pagedllm.engine import llm_engine\n")
    broken = _lint_imports(tmp_path)
    assert broken.returncode != 0
    assert "The runtime stack: each layer imports only the layers below it BROKEN" in broken.stdout
    assert "pagedllm.core.upward -> pagedllm.engine.llm_engine" in broken.stdout


def test_the_package_graph_has_no_cycle() -> None:
    graph = grimp.build_graph("pagedllm", "pagedllm_bench")

    def package(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2]) if parts[0] == "pagedllm" else parts[0]

    edges: dict[str, set[str]] = {}
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if package(module) != package(imported):
                edges.setdefault(package(module), set()).add(package(imported))
    assert {"pagedllm.core", "pagedllm.engine", "pagedllm.serving", "pagedllm_bench"} <= set(edges)

    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import cycle between packages: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        for nxt in sorted(edges.get(node, ())):
            visit(nxt, path + [node])
        done.add(node)

    for node in sorted(edges):
        visit(node, [])


def test_the_openai_door_and_the_launcher_import_no_torch() -> None:
    for module in ("pagedllm.serving.openai.app", "pagedllm.serving.cli"):
        check = f"import sys, {module}; loaded = [m for m in ('torch', 'transformers.modeling_utils') if m in sys.modules]; " \
                "print(loaded); sys.exit(1 if loaded else 0)"
        result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300, cwd="/")
        assert result.returncode == 0, f"{module} loads {result.stdout.strip()} {result.stderr[-2000:]}"
