"""A pytest plugin collecting measured figures and printing them after the run.

Fault tests measure things that are allowed but must be reported (the overlap a restart
without persistence allows, cancellation latency). They call ``figures.add(name, text)``;
the figures are listed in the terminal summary, so every run shows them. Under
pytest-xdist each worker sends its figures to the controller when it finishes
(``workeroutput``), which lists them all.
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


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # (an xdist worker: the controller prints them)
        workeroutput["asynclock_figures"] = list(_FIGURES.rows)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """(xdist's controller) a worker finished: keep the figures it measured."""
    output = getattr(node, "workeroutput", {})
    for name, text in output.get("asynclock_figures", []):
        _FIGURES.add(name, text)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _FIGURES.rows:
        terminalreporter.section("measured figures")
        for name, text in _FIGURES.rows:
            terminalreporter.write_line(f"{name}: {text}")
