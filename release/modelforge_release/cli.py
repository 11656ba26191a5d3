"""The ``modelforge-release`` command line (click).

Exit codes: 0 ok; 1 a file failed its check or could not be read; 2 usage, a malformed or
unsafe SHA256SUMS line, or a template problem.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from modelforge_contract import EXIT_USAGE, __version__

from .sums import (
    SumsError,
    check_version,
    compute_entries,
    names_relative_to,
    order_by_template,
    read_template,
    write_sums,
)
from .verify import check_sums

EXIT_FAILED = 1
PROG = "modelforge-release"

log = logging.getLogger(__name__)


def _fail(message: str, code: int) -> None:
    click.echo(f"{PROG}: {message}", err=True)
    sys.exit(code)


@click.group()
@click.version_option(__version__, prog_name=PROG)
@click.option("-v", "--verbose", is_flag=True, help="Log each file hashed, with its timing.")
def main(verbose: bool) -> None:
    """Release tooling: SHA256SUMS for a ModelForge release, and checking it."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(levelname)s %(name)s: %(message)s",
    )


@main.command()
@click.option(
    "--template",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="SHA256SUMS.template: the release file names, in the order they are listed.",
)
@click.option("--version", "release_version", help="Fills {version} in the template.")
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("SHA256SUMS"),
    show_default=True,
    help="Where to write; names in it are relative to its directory.",
)
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
def sums(
    template: Path | None, release_version: str | None, output: Path, files: tuple[Path, ...]
) -> None:
    """Write SHA256SUMS for FILES in GNU coreutils format (sha256sum -c reads it).

    Without --template the lines follow the order of FILES; with it, the template's order,
    and FILES must be exactly the files it lists.
    """
    try:
        if release_version is not None:
            if template is None:
                raise SumsError("--version only fills a --template")
            check_version(release_version)
        named = names_relative_to(output.parent, files)
        if output.name in {name for name, _ in named}:
            raise SumsError(f"{output} cannot list itself")
        if template is not None:
            named = order_by_template(named, read_template(template, release_version))
    except SumsError as exc:
        _fail(str(exc), EXIT_USAGE)
    try:
        # Every file is hashed before the output is opened: a missing input leaves any
        # previous SHA256SUMS untouched.
        entries = compute_entries(named, progress=sys.stderr)
    except OSError as exc:
        _fail(f"cannot read {exc.filename}: {exc.strerror or exc}", EXIT_FAILED)
    write_sums(output, entries)


@main.command("verify-sums")
@click.option(
    "--sums",
    "sums_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=Path("SHA256SUMS"),
    show_default=True,
    help="The SHA256SUMS file; names in it are read relative to its directory.",
)
@click.option("--ignore-missing", is_flag=True, help="Skip listed files that do not exist.")
@click.option("--quiet", is_flag=True, help="Print nothing for files that match.")
def verify_sums(sums_path: Path, ignore_missing: bool, quiet: bool) -> None:
    """Check every file SHA256SUMS lists, like sha256sum -c.

    Prints NAME: OK, NAME: FAILED or NAME: FAILED open or read, then sha256sum's warnings.
    Exit 1 on any failure, 2 on a malformed or unsafe line (nothing is read then).
    """
    try:
        outcome = check_sums(
            sums_path,
            ignore_missing=ignore_missing,
            quiet=quiet,
            out=sys.stdout,
            err=sys.stderr,
            progress=sys.stderr,
            prog=PROG,
        )
    except SumsError as exc:
        _fail(str(exc), EXIT_USAGE)
    if not outcome.ok:
        sys.exit(EXIT_FAILED)
