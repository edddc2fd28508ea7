"""The core's structure (issue 20): one owner for each object's state.

The import layers themselves are checked by ``lint-imports`` in ``./dev lint`` (the
contract is in pyproject.toml). Here: no module of asynclock assigns (or deletes) a
private attribute of an object that another module owns. A module owns the private
attributes it sets on ``self``; an object of another module's class is changed only
through that class's methods.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "asynclock"

# Writes to another library's objects, each for a reason of its own.
FOREIGN = {
    # A connection of a loop that has closed is torn down by hand: its own close would
    # need the closed loop (redis-py's connection, asyncio's transport; see _leftovers).
    ("_redis/_leftovers.py", "transport._sock"),
    ("_redis/_leftovers.py", "connection._reader"),
    ("_redis/_leftovers.py", "connection._writer"),
}


def _private_writes(tree: ast.AST) -> tuple[set[str], list[tuple[int, str, str]]]:
    """(private attributes the module sets on self/cls, other private writes)."""
    own: set[str] = set()
    others: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for sub in ast.walk(target):
                if not isinstance(sub, ast.Attribute):
                    continue
                name = sub.attr
                if not name.startswith("_") or name.startswith("__"):
                    continue
                if isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls"):
                    own.add(name)
                else:
                    others.append((sub.lineno, ast.unparse(sub), name))
    return own, others


def test_no_module_writes_another_modules_private_state() -> None:
    found = []
    checked = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        own, others = _private_writes(ast.parse(path.read_text()))
        relative = str(path.relative_to(PACKAGE))
        for line, text, name in others:
            checked += 1
            if name in own or (relative, text) in FOREIGN:
                continue  # (its own objects: another instance of its own class)
            found.append(f"asynclock/{relative}:{line}: {text}")
    assert checked, "no write looked at: the check checks nothing"
    assert not found, "private state written from outside its module:\n" + "\n".join(found)


def test_the_check_finds_a_write_from_outside() -> None:
    own, others = _private_writes(
        ast.parse(
            "def f(lease):\n    lease._due = 1.0\n\nclass C:\n    def g(self):\n"
            "        self._x = 1\n        other._x = 2\n"
        )
    )
    assert own == {"_x"}
    assert [(text, name) for _, text, name in others] == [
        ("lease._due", "_due"),
        ("other._x", "_x"),
    ]


def _tenure_state() -> set[str]:
    """The tenure's state: the slots of ``_lifecycle._lease.Tenure``."""
    tree = ast.parse((PACKAGE / "_lifecycle" / "_lease.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Tenure":
            for statement in node.body:
                if (
                    isinstance(statement, ast.Assign)
                    and isinstance(statement.targets[0], ast.Name)
                    and statement.targets[0].id == "__slots__"
                ):
                    return set(ast.literal_eval(statement.value))
    raise AssertionError("Tenure.__slots__ not found")


def test_no_module_writes_the_tenures_state() -> None:
    """A lease's tenure owns its state (public names, read by the watchdog, the release
    and the ways in): only its own module assigns it, everyone else asks its methods."""
    state = _tenure_state()
    assert {"state", "deadline", "closing", "guards", "due"} <= state
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = str(path.relative_to(PACKAGE))
        if relative == "_lifecycle/_lease.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr in state
                    and not (isinstance(target.value, ast.Name) and target.value.id == "self")
                ):
                    found.append(f"asynclock/{relative}:{node.lineno}: {ast.unparse(target)}")
    assert not found, "the tenure's state written from outside its module:\n" + "\n".join(found)
