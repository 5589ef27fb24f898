"""The step engine sits below the analyses: nothing in ``comminsight.semantic`` imports ``comminsight.analysis``.

The straggler analysis and step recovery once imported each other; the matching code they share
lives in ``comminsight.semantic.matching``, one floor below both. Read from the source (every
import statement, also those inside functions), so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import comminsight.semantic

SEMANTIC = Path(comminsight.semantic.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_semantic_module_imports_an_analysis() -> None:
    offenders = {
        path.name: sorted(m for m in _imported_modules(path) if m.startswith("comminsight.analysis"))
        for path in sorted(SEMANTIC.glob("*.py"))
    }
    assert {name: mods for name, mods in offenders.items() if mods} == {}


def test_the_straggler_analysis_and_step_recovery_share_one_matching_module() -> None:
    stragglers = Path(comminsight.semantic.__file__).parents[1] / "analysis" / "stragglers.py"
    assert "comminsight.semantic.matching" in _imported_modules(stragglers)
    assert "comminsight.semantic.matching" in _imported_modules(SEMANTIC / "steps.py")
