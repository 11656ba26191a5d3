"""``modelforge models pull NAME hf://ORG/REPO[@REVISION]``: a model from a hub, downloaded
once onto this host's seed cache (docs/models.md, "Pulling from a hub").

It runs in this process, against this host's state directory, as ``models import`` does:
the revision resolved to a commit, the matching files fetched (a progress bar per file on a
terminal, on stderr), resumed after a kill or a cut connection, verified against the hub's
hashes, then recorded. The hub token set with ``modelforge hub-token set`` is sent to the
hub; ``HF_ENDPOINT`` names a mirror.
"""

from __future__ import annotations

import sys

import click
from huggingface_hub.utils import tqdm as hub_tqdm

from modelforge_contract import EXIT_CHECK_FAILED, EXIT_NOT_FOUND, EXIT_SYSTEM, EXIT_USAGE
from modelforge_contract.hub import (
    HUB_NO_MATCHING_FILES,
    HUB_REPO_NOT_FOUND,
    HUB_REVISION_NOT_FOUND,
    HUB_SOURCE_INVALID,
    HubSourceError,
    hub_source,
    parse_hub_url,
)
from modelforge_contract.models import DISK_FULL, INSUFFICIENT_SPACE

from ..core.errors import ApiError
from ..models import catalog, pulls
from ..models.hub import HubFile, PullPlan
from ..models.hub_files import Progress
from ..store import audit
from .errors import CliError
from .support import JSON_OPTION, Context, emit, files_text, size_text

# The answer is no (1) unless the hub says there is no such thing (7), the disk is the
# trouble (9), or the command line is (2).
_EXITS = {
    HUB_REPO_NOT_FOUND: EXIT_NOT_FOUND,
    HUB_REVISION_NOT_FOUND: EXIT_NOT_FOUND,
    INSUFFICIENT_SPACE: EXIT_SYSTEM,
    DISK_FULL: EXIT_SYSTEM,
}
_USAGE = {HUB_SOURCE_INVALID, HUB_NO_MATCHING_FILES}


def _exit_code(exc: ApiError) -> int:
    if exc.code in _EXITS:
        return _EXITS[exc.code]
    if exc.code in _USAGE or (exc.status == 400 and not exc.code.startswith("HUB_")):
        return EXIT_USAGE
    return EXIT_CHECK_FAILED


class _Bars(Progress):
    """One progress bar per file on stderr (huggingface_hub's own tqdm bars)."""

    def __init__(self) -> None:
        self.bar = None

    def started(self, plan: PullPlan, here: dict[str, int]) -> None:
        click.echo(
            f"{plan.url}: {files_text(len(plan.files))}, {size_text(plan.bytes_total)}"
            f"{f', {size_text(sum(here.values()))} already here' if any(here.values()) else ''}",
            err=True,
        )

    def file_started(self, file: HubFile, done: int) -> None:
        self.bar = hub_tqdm(
            total=file.size, initial=done, desc=file.path, unit="B", unit_scale=True,
            unit_divisor=1024, file=sys.stderr, leave=True,
        )  # fmt: skip

    def advanced(self, count: int) -> None:
        if self.bar is not None:
            self.bar.update(count)

    def file_finished(self, file: HubFile) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        else:
            click.echo(f"{file.path}: already here", err=True)


@click.command("pull")
@click.argument("name")
@click.argument("source", metavar="hf://ORG/REPO[@REVISION]")
@click.option(
    "--include",
    "include",
    multiple=True,
    metavar="GLOB",
    help="Only the files matching this pattern ('*' crosses folders); repeatable.",
)
@click.option(
    "--exclude", "exclude", multiple=True, metavar="GLOB", help="Leave these out; repeatable."
)
@click.option("--revision", help="The revision to record (default: the commit pulled).")
@JSON_OPTION
@click.pass_obj
def pull_command(
    obj: Context,
    name: str,
    source: str,
    include: tuple[str, ...],
    exclude: tuple[str, ...],
    revision: str | None,
    as_json: bool,
) -> None:
    """Download a model from a hub into the seed cache as model NAME (HF_ENDPOINT: a mirror).

    The revision (default main) is resolved to a commit; only the files matching --include
    and not --exclude are fetched, each verified against the hub's hashes; a killed or cut
    pull resumes where it stopped. Gated and private repositories need the token set with
    `modelforge hub-token set`.
    """
    store = obj.store()
    try:
        repo, hub_revision = parse_hub_url(source)
        wanted = hub_source(repo, hub_revision, include, exclude)
    except HubSourceError as exc:
        raise CliError(
            f"{exc} (HUB_SOURCE_INVALID)",
            "name it as hf://ORG/REPO or hf://ORG/REPO@REVISION (a branch, tag or commit)",
        ) from None
    progress = _Bars() if sys.stderr.isatty() and not as_json else None
    try:
        plan, imported = pulls.pull_model(
            store, obj.settings, name, wanted, audit.CLI_ACTOR, revision, progress
        )
    except ApiError as exc:
        raise CliError(f"{exc.message} ({exc.code})", exc.next_step, _exit_code(exc)) from None
    view = catalog.model_view(imported.model)
    note = "Pulled" if imported.created else "Already pulled as"
    emit(
        as_json,
        view,
        f"{note} {view['name']} revision {view['revision']} from {plan.url}: "
        f"{files_text(view['file_count'])}, {size_text(view['size_bytes'])}, {view['digest']}",
    )
