"""MkDocs hooks: the reference pages generated from their declarations, files outside docs/.

A page asks for generated text with a marker line, replaced at every build so that it never
goes stale:

- ``<!-- generated: cli -->``: every command and flag, from the argparse parser;
- ``<!-- generated: settings -->``: every ``DISCOVERY_*`` variable, from ``Settings``;
- ``<!-- generated: fields -->``: the record's stored fields, from ``EngineRecord``;
- ``<!-- generated: schema -->``: the record's JSON Schema (``docs/record.schema.json``);
- ``<!-- include: PATH -->``: a file of the repository (``deploy/README.md``,
  ``bench/RESULTS.md``), its links rebased onto the site.

The benchmarks' plots (``bench/*.png``) and latest sections (``bench/results/*.md``) become
files of the site under ``performance/``.
"""

from __future__ import annotations

import argparse
import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

from discovery._records.record import field_table
from discovery._settings import settings_table
from discovery.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
GENERATED = re.compile(r"^<!-- (generated|include): (\S+) -->$", re.M)
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
# Where the site puts the repository's folders it shows (on_files), and the files it includes.
SITE_COPIES = {"bench/results": "performance/results", "bench": "performance"}
INCLUDED = {"bench/RESULTS.md": "performance.md", "deploy/README.md": "operations/deployment.md"}


def on_files(files: Files, config: Any) -> Files:
    """Add the benchmarks' plots and latest sections to the site."""
    for path in sorted((ROOT / "bench").glob("*.png")):
        files.append(File.generated(config, f"performance/{path.name}", abs_src_path=str(path)))
    for path in sorted((ROOT / "bench" / "results").glob("*.md")):
        text = _rebase(path.read_text(), "bench/results", "performance/results")
        files.append(File.generated(config, f"performance/results/{path.name}", content=text))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Rebase the page's links onto the site; replace each marker line with what it asks for.

    Pages link to the repository's files as a reader of the repository sees them
    (``../bench/RESULTS.md``); on the site those become the pages that show them.
    """
    page_dir = posixpath.dirname(f"docs/{page.file.src_uri}")
    markdown = _rebase(markdown, page_dir, page_dir)

    def replace(match: re.Match[str]) -> str:
        kind, what = match.groups()
        if kind == "include":
            text = (ROOT / what).read_text()
            return _rebase(text, posixpath.dirname(what), page_dir)
        return GENERATORS[what]()

    return GENERATED.sub(replace, markdown)


def _rebase(text: str, source_dir: str, page_dir: str) -> str:
    """``text``'s relative links, written in ``source_dir``, as seen from ``page_dir``.

    A link into docs/ or into a folder the site copies stays a link; a link to any other
    file of the repository becomes its path in code (the site does not hold it).
    """

    def rebase(match: re.Match[str]) -> str:
        bang, label, target = match.groups()
        if re.match(r"[a-z]+:|#", target):
            return match.group(0)
        path, _, anchor = target.partition("#")
        repository_path = posixpath.normpath(posixpath.join(source_dir, path))
        site_path = _site_path(repository_path)
        if site_path is None:
            return label if f"`{repository_path}`" in label else f"{label} (`{repository_path}`)"
        relative = posixpath.relpath(site_path, page_dir.removeprefix("docs").lstrip("/") or ".")
        return f"{bang}[{label}]({relative}{'#' + anchor if anchor else ''})"

    # Code blocks keep their text: `x[0](y)` is a call, not a link.
    parts = re.split(r"(^```.*?^```$)", text, flags=re.M | re.S)
    return "".join(p if p.startswith("```") else LINK.sub(rebase, p) for p in parts)


def _site_path(repository_path: str) -> str | None:
    """Where a file of the repository is on the site, or None when it is not there."""
    if repository_path in INCLUDED:
        return INCLUDED[repository_path]
    if repository_path.startswith("docs/"):
        return repository_path.removeprefix("docs/")
    for folder, copy in SITE_COPIES.items():
        if repository_path.startswith(f"{folder}/") and repository_path.endswith((".md", ".png")):
            rest = repository_path.removeprefix(f"{folder}/")
            if "/" not in rest:
                return f"{copy}/{rest}"
    return None


def cli_reference() -> str:
    """Every command of ``discovery`` with its flags, from the parser itself.

    Flag groups several commands share (the etcd settings, metrics) are listed once, at
    the end, and named where a command takes them.
    """
    parser = build_parser()
    (subparsers,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in subparsers._choices_actions}
    commands = subparsers.choices
    takers: dict[tuple[str, ...], list[str]] = {}
    for name, command in commands.items():
        for group in _groups(command):
            takers.setdefault(_key(group), []).append(name)
    # A command's own arguments stay with it, even where another has the same.
    own = ("options", "positional arguments")
    shared = {key for key, names in takers.items() if len(names) > 1 and key[0] not in own}
    out = [f"`discovery`: {parser.description}", ""]
    for name, command in commands.items():
        out += [f"## discovery {name}", "", f"{helps.get(name) or ''}.", ""]
        if command.description:
            out += [command.description, ""]
        out += ["```text", command.format_usage().strip(), "```", ""]
        for group in _groups(command):
            if _key(group) in shared:
                out += [f"And the [{group.title}](#{_anchor(group.title or '')}) flags.", ""]
            else:
                out += _flag_table(command, group, bold_title=True)
    for key in sorted(shared):
        name = takers[key][0]
        group = next(g for g in _groups(commands[name]) if _key(g) == key)
        out += [f"## {group.title}", "", *_flag_table(commands[name], group, bold_title=False)]
    return "\n".join(out)


def _groups(parser: argparse.ArgumentParser) -> list[argparse._ArgumentGroup]:
    """The parser's argument groups that hold an argument other than ``--help``."""
    return [
        g
        for g in parser._action_groups
        if any(not isinstance(a, argparse._HelpAction) for a in g._group_actions)
    ]


def _key(group: argparse._ArgumentGroup) -> tuple[str, ...]:
    """What makes two commands' groups the same: their title and their arguments."""
    return (group.title or "", *(a.dest for a in group._group_actions))


def _flag_table(
    parser: argparse.ArgumentParser, group: argparse._ArgumentGroup, *, bold_title: bool
) -> list[str]:
    formatter = parser._get_formatter()
    rows = [f"**{group.title}**", ""] if bold_title and group.title != "options" else []
    rows += ["| argument | meaning |", "|---|---|"]
    for action in group._group_actions:
        if isinstance(action, argparse._HelpAction):
            continue
        invocation = formatter._format_action_invocation(action)
        meaning = formatter._expand_help(action) if action.help else ""
        if not meaning and action.default not in (None, False, [], argparse.SUPPRESS):
            meaning = f"default: {action.default}"
        rows.append(f"| `{invocation}` | {meaning.replace('|', '&#124;')} |")
    return [*rows, ""]


def _anchor(title: str) -> str:
    """The id MkDocs gives a heading (Python-Markdown's toc slugify)."""
    slug = re.sub(r"[^\w\s-]", "", title).strip().lower()
    return re.sub(r"[-\s]+", "-", slug)


def record_schema() -> str:
    """The record's JSON Schema, as the repository holds it."""
    schema = (ROOT / "docs" / "record.schema.json").read_text().strip()
    return f"```json\n{schema}\n```"


GENERATORS = {
    "cli": cli_reference,
    "settings": settings_table,
    "fields": field_table,
    "schema": record_schema,
}
