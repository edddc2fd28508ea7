"""A pytest plugin collecting measured figures and printing them after the run.

Fault tests measure things that are allowed but must be reported (the overlap a restart
without persistence allows, cancellation latency). They call ``figures.add(name, text)``;
the figures are listed in the terminal summary, so every run shows them.
"""

from __future__ import annotations

import pytest


class Figures:
    """The figures measured by this run, in the order they were added."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str]] = []

    def add(self, name: str, text: str) -> None:
        self.rows.append((name, text))


_FIGURES = Figures()


@pytest.fixture(scope="session")
def figures() -> Figures:
    """Where tests record what they measured (see the terminal summary)."""
    return _FIGURES


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _FIGURES.rows:
        terminalreporter.section("measured figures")
        for name, text in _FIGURES.rows:
            terminalreporter.write_line(f"{name}: {text}")
