"""The documentation's links, and its commands against the command line they document.

The site is built here as `make docs` builds it (`mkdocs build --strict`, never `--quiet`:
quiet mode drops the warnings strict mode counts), and must build without a warning: every
link and anchor resolves (mkdocs.yml's `validation:`). A tiny site with a dead link, built with
the same settings, shows that the check fails when it should; the README's links into docs/ are
checked against the built site. The other tests check what mkdocs cannot: that every
`specdecode ...` command shown in a shell block still parses (a renamed or removed flag fails
here), and that the generated CLI reference covers every subcommand.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specdecode.cli import build_parser
from specdecode.config import parse_spec_types

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_DOC_LINK = re.compile(r"\]\(docs/([^)#\s]+\.md)(?:#([^)\s]+))?\)")
SHELL_BLOCK = re.compile(r"^ *```(?:sh|bash)\n(.*?)^ *```", re.MULTILINE | re.DOTALL)
ENVIRONMENT = re.compile(r"^(?:[A-Z_]+=\S+ )+")  # LLAMA_CPP_LIB_PATH=... specdecode ...


def shown_commands() -> list[tuple[str, str]]:
    """(page, command line) for every `specdecode` line of the pages' shell blocks."""
    commands = []
    for page in sorted(DOCS.rglob("*.md")):
        for block in SHELL_BLOCK.findall(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                line = ENVIRONMENT.sub("", line.strip())
                if line.startswith("specdecode "):
                    commands.append((str(page.relative_to(DOCS)), line))
    return commands


def load_hook():
    spec = importlib.util.spec_from_file_location("cli_reference", DOCS / "hooks" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_show_commands():
    assert len(shown_commands()) > 50


@pytest.mark.parametrize(("page", "command"), shown_commands())
def test_a_shown_command_parses(page: str, command: str):
    words = shlex.split(command, comments=True)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = build_parser().parse_args(words[1:])
    except SystemExit as stop:
        if stop.code:  # --version exits with 0
            pytest.fail(f"{page}: {command}\n{errors.getvalue()}")
        return
    if getattr(args, "spec_type", None) is not None:
        parse_spec_types(args.spec_type)  # raises SpecdecodeError on an unknown name


def test_the_cli_reference_has_every_subcommand():
    hook = load_hook()
    reference = hook.cli_reference()
    parser = build_parser()
    progs = []
    pending = [parser]
    while pending:
        children = [child for _name, child in hook.subcommands(pending.pop())]
        progs.extend(child.prog for child in children)
        pending.extend(children)
    assert "specdecode generate" in progs and "specdecode train eagle3" in progs
    for prog in progs:
        assert re.search(rf"^#+ {re.escape(prog)}$", reference, re.MULTILINE), prog
    assert "--spec-draft-n-max" in reference


def test_the_cli_page_keeps_its_marker():
    assert load_hook().MARKER in (DOCS / "cli.md").read_text()


def test_subcommands_lists_aliases_once():
    parser = argparse.ArgumentParser(prog="tool")
    commands = parser.add_subparsers()
    commands.add_parser("run", aliases=["r"])
    commands.add_parser("stop")
    assert [name for name, _child in load_hook().subcommands(parser)] == ["run", "stop"]


def build_site(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` as `make docs` runs it, into `site`, without the theme's banner."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=600,
    )


def warnings_of(build: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in (build.stdout + build.stderr).splitlines() if "WARNING" in line]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's site, built once; the build must pass without a single warning."""
    site = tmp_path_factory.mktemp("site")
    build = build_site(ROOT / "mkdocs.yml", site)
    assert build.returncode == 0 and not warnings_of(build), build.stdout + build.stderr
    return site


def test_the_site_builds_without_a_warning(site: Path):
    assert (site / "index.html").is_file() and (site / "gguf" / "index.html").is_file()


def test_the_config_warns_on_every_broken_link():
    validation = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["validation"]
    for check in ("not_found", "anchors", "unrecognized_links", "absolute_links", "omitted_files"):
        assert validation.get(check) == "warn", check


def test_make_never_builds_the_site_quietly():
    for line in (ROOT / "Makefile").read_text().splitlines():
        if "mkdocs build" in line:
            assert "--strict" in line and not re.search(r"\s(-q|--quiet)\b", line), line


DEAD_LINKS = {
    "a missing anchor on another page": "[setup](other.md#no-such-heading)",
    "a missing anchor on the same page": "[below](#no-such-heading)",
    "a missing page": "[gone](missing.md)",
    "a page outside the docs": "[outside](../README.md)",
}


@pytest.mark.parametrize("link", DEAD_LINKS.values(), ids=DEAD_LINKS.keys())
def test_a_dead_link_fails_the_build(tmp_path: Path, link: str):
    """A site with the project's settings (mkdocs.yml less its pages) and one dead link."""
    settings = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    for own in ("nav", "hooks", "exclude_docs", "docs_dir", "site_dir"):
        settings.pop(own, None)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n## Setup\n\nSee [other](other.md#usage).\n")
    (docs / "other.md").write_text(f"# Other\n\n## Usage\n\nBack [home](index.md#setup).\n\n{link}\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(yaml.safe_dump({**settings, "docs_dir": "docs"}))
    broken = build_site(config, tmp_path / "site")
    assert broken.returncode != 0
    assert any(link[link.index("(") + 1 : -1] in line for line in warnings_of(broken)), broken.stderr
    (docs / "other.md").write_text("# Other\n\n## Usage\n\nBack [home](index.md#setup).\n")
    assert build_site(config, tmp_path / "site").returncode == 0  # the same site, link removed


def test_the_readme_links_into_the_site(site: Path):
    links = README_DOC_LINK.findall((ROOT / "README.md").read_text())
    assert len(links) > 20
    for page, anchor in links:
        html = site / page.removesuffix(".md") / "index.html"
        if page == "index.md":
            html = site / "index.html"
        assert html.is_file(), f"README links to docs/{page}, which is not a page"
        if anchor:
            assert f'id="{anchor}"' in html.read_text(), f"README links to docs/{page}#{anchor}"
