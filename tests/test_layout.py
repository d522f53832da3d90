"""The shape of the house: packages by responsibility whose imports point one way (import-linter's layers
contract in pyproject.toml), each saying what it holds and what it may import, few modules at the top, and no
source file or function past its size budget."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import ddpkit

PACKAGE = Path(ddpkit.__file__).parent
ROOT = PACKAGE.parent.parent
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def test_imports_point_one_way():
    """import-linter's contract (pyproject.toml): a layer imports only the layers below it."""
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint) if lint.exists() else "lint-imports", "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "KEPT" in done.stdout, done.stdout + done.stderr


def test_every_package_says_what_it_holds_and_what_it_may_import():
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import:" in doc and len(doc.split()) > 15, f"{init}: say what it holds and what it may import"


def test_the_top_holds_few_modules():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 6, modules


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_file_or_function_past_its_budget(path):
    text = path.read_text()
    assert text.count("\n") <= MAX_FILE_LINES, f"{path}: {text.count(chr(10))} lines; split it by responsibility"
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{path}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_tests_mirror_the_packages_with_unique_names():
    tests = Path(__file__).parent
    names = [p.name for p in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    for folder in (p for p in tests.iterdir() if p.is_dir() and list(p.glob("test_*.py"))):
        assert folder.name in packages | {"compat", "gpu"}, f"tests/{folder.name} mirrors no package of ddpkit"
