"""The site's build hooks (mkdocs.yml, ``hooks``).

- The build fails when a public name has no docstring, or a public module is missing
  from the API reference (docs/api.md). The public names are those in ``__all__`` of
  :data:`PUBLIC`'s modules, read by griffe as mkdocstrings reads them (an attribute's
  docstring is the string under it).
- The README is the site's home page (``index.md``), so that it stays the one front page.
- Links are written for reading the repository (``../README.md``, ``docs/jobs.md``,
  ``../benchmarks/results.md``); on the site, one to the README goes to the home page,
  one into docs/ to that page, and one to any other file of the repository becomes its
  path in the text (the site does not carry it). mkdocs then checks every link and
  anchor that is left (``validation`` in mkdocs.yml; ``--strict`` fails on a broken one).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

import griffe
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

PUBLIC = (
    "asynclock",
    "asynclock.testing",
    "asynclock.instrumentation",
    "asynclock.postgres",
    "asynclock.fastapi",
)


def undocumented(root: Path) -> list[str]:
    """The public names (``module.name``) without a docstring."""
    package = griffe.load("asynclock", search_paths=[str(root)])
    missing: list[str] = []
    for path in PUBLIC:
        module = package if path == "asynclock" else package[path.removeprefix("asynclock.")]
        for name in map(str, module.exports or ()):
            if not module[name].docstring:
                missing.append(f"{path}.{name}")
    return missing


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    root = Path(config.config_file_path).parent
    api = (Path(config.docs_dir) / "api.md").read_text()
    absent = [path for path in PUBLIC if f"::: {path}\n" not in api]
    if absent:
        raise PluginError(f"docs/api.md does not document: {', '.join(absent)}")
    missing = undocumented(root)
    if missing:
        raise PluginError(
            "public names without a docstring (the API reference would show nothing): "
            + ", ".join(missing)
        )
    return config


_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:|^#", re.IGNORECASE)


def site_markdown(markdown: str, source: str) -> str:
    """``markdown`` of the repository file ``source`` (``README.md``,
    ``docs/jobs.md``) with its links made the site's (see the module's docstring)."""
    base = posixpath.dirname(source)

    def rewrite(match: re.Match[str]) -> str:
        image, text, target = match.groups()
        if _EXTERNAL.match(target):
            return match.group(0)
        path, hash_, anchor = target.partition("#")
        in_repo = posixpath.normpath(posixpath.join(base, path))
        if in_repo == "README.md":
            return f"{image}[{text}](index.md{hash_}{anchor})"
        if in_repo.startswith("docs/"):
            relative = in_repo.removeprefix("docs/")
            return f"{image}[{text}]({relative}{hash_}{anchor})"
        if image:
            return f"(the repository's `{in_repo}`)"
        return f"{text} (the repository's `{in_repo}`)"

    return _LINK.sub(rewrite, markdown)


def on_files(files: Files, config: MkDocsConfig) -> Files:
    readme = Path(config.config_file_path).parent / "README.md"
    files.append(
        File.generated(config, "index.md", content=site_markdown(readme.read_text(), "README.md"))
    )
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, **_: Any) -> str:
    if page.file.src_uri == "index.md":
        return markdown  # (the README, rewritten when it was added)
    return site_markdown(markdown, f"docs/{page.file.src_uri}")
