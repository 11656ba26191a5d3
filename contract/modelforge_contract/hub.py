"""Models from a hub (docs/architecture.md §10, docs/models.md "Pulling from a hub").

``modelforge models pull NAME hf://ORG/REPO[@REVISION]`` (or ``POST /admin/models`` with a
``hub`` source) downloads once, onto the control plane: the revision is resolved to a commit,
only the files matching ``include`` (and not ``exclude``) are fetched, each is verified
against the hub's hashes, and the revision enters the seed cache as an import does. The
nodes get it by replication; the hub token never leaves the control plane.

What is here is what both the CLI and automation read: the source's spelling, the paths,
the states of a pull and the error codes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from . import API_PREFIX

# -- paths ---------------------------------------------------------------------

PATH_ADMIN_MODEL_PULLS = f"{API_PREFIX}/admin/model-pulls"
PATH_ADMIN_MODEL_PULL = f"{PATH_ADMIN_MODEL_PULLS}/<pull_id>"
PATH_ADMIN_HUB_TOKEN = f"{API_PREFIX}/admin/hub-token"

# -- the source ------------------------------------------------------------------

HUB_HUGGINGFACE = "huggingface"
HUBS = (HUB_HUGGINGFACE,)
SCHEME = "hf://"
DEFAULT_REVISION = "main"
# ORG/REPO as the hub allows them: letters, digits, '-', '_', '.'; no '--' or '..'.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
REPO_RE = re.compile(rf"{_PART}/{_PART}")
# A branch, a tag or a commit; refs/pr/N too. Never a path that leaves the resolve route.
HUB_REVISION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}")
PATTERN_MAX_CHARS = 200
PATTERNS_MAX = 50

# -- a pull's states -----------------------------------------------------------------
# ``downloading`` while bytes move (bytes_done of bytes_total); ``done`` once the revision is
# in the seed cache (its model view is in the pull); ``failed`` with an error.

PULL_DOWNLOADING = "downloading"
PULL_DONE = "done"
PULL_FAILED = "failed"
PULL_STATES = (PULL_DOWNLOADING, PULL_DONE, PULL_FAILED)

# -- error codes (docs/models.md says what each means and what to do) ------------------

HUB_SOURCE_INVALID = "HUB_SOURCE_INVALID"  # not hf://ORG/REPO[@REVISION], or a bad pattern
HUB_REPO_NOT_FOUND = "HUB_REPO_NOT_FOUND"  # no such repository (or private, no access)
HUB_REVISION_NOT_FOUND = "HUB_REVISION_NOT_FOUND"  # no such branch, tag or commit
HUB_NO_MATCHING_FILES = "HUB_NO_MATCHING_FILES"  # --include/--exclude left no file
HUB_TOKEN_REQUIRED = "HUB_TOKEN_REQUIRED"  # the hub answered 401: gated or private
HUB_ACCESS_DENIED = "HUB_ACCESS_DENIED"  # the hub answered 403: the token may not read it
HUB_TOKEN_UNREADABLE = "HUB_TOKEN_UNREADABLE"  # the sealed token does not open here
HUB_UNREACHABLE = "HUB_UNREACHABLE"  # no connection (offline, DNS, proxy, HF_HUB_OFFLINE)
HUB_RATE_LIMITED = "HUB_RATE_LIMITED"  # the hub answered 429
HUB_DOWNLOAD_FAILED = "HUB_DOWNLOAD_FAILED"  # the hub failed part-way (5xx, a cut stream)
PULL_IN_PROGRESS = "PULL_IN_PROGRESS"  # another pull is downloading one of these files
PULL_NOT_FOUND = "PULL_NOT_FOUND"  # no such pull in this control-plane process
# Also answered: INSUFFICIENT_SPACE and DIGEST_MISMATCH (modelforge_contract.models).


class HubSourceError(ValueError):
    """A hub source is not one this control plane can pull; the message says why."""


@dataclass(frozen=True)
class HubSource:
    """What to pull: ``hf://ORG/REPO[@REVISION]`` and the file patterns."""

    repo: str
    revision: str = DEFAULT_REVISION
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    hub: str = HUB_HUGGINGFACE

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.repo}@{self.revision}"


def check_repo(repo: str) -> str:
    if not REPO_RE.fullmatch(repo) or "--" in repo or ".." in repo:
        raise HubSourceError(f"{repo!r} is not a repository (ORG/REPO: letters, digits, '-_.')")
    return repo


def check_hub_revision(revision: str) -> str:
    if (
        not HUB_REVISION_RE.fullmatch(revision)
        or ".." in revision
        or "//" in revision
        or revision.endswith("/")
    ):
        raise HubSourceError(f"{revision!r} is not a branch, tag or commit")
    return revision


def check_patterns(patterns: tuple[str, ...] | list[str], what: str) -> tuple[str, ...]:
    if len(patterns) > PATTERNS_MAX:
        raise HubSourceError(f"more than {PATTERNS_MAX} {what} patterns")
    for pattern in patterns:
        if not pattern or len(pattern) > PATTERN_MAX_CHARS or not pattern.isprintable():
            raise HubSourceError(
                f"{what} pattern {pattern!r} must be 1-{PATTERN_MAX_CHARS} printable characters"
            )
    return tuple(patterns)


def parse_hub_url(text: str) -> tuple[str, str]:
    """``(repo, revision)`` of ``hf://ORG/REPO[@REVISION]`` (``main`` when none is given)."""
    if not text.startswith(SCHEME):
        raise HubSourceError(f"{text!r} does not start with {SCHEME} (hf://ORG/REPO[@REVISION])")
    rest = text[len(SCHEME) :]
    repo, at, revision = rest.partition("@")
    if at and not revision:
        raise HubSourceError(f"{text!r} names no revision after '@'")
    return check_repo(repo), check_hub_revision(revision or DEFAULT_REVISION)


def hub_source(
    repo: str,
    revision: str | None = None,
    include: tuple[str, ...] | list[str] = (),
    exclude: tuple[str, ...] | list[str] = (),
    hub: str = HUB_HUGGINGFACE,
) -> HubSource:
    """A checked HubSource; HubSourceError naming what is wrong."""
    if hub not in HUBS:
        raise HubSourceError(f"hub {hub!r} is not one of {', '.join(HUBS)}")
    return HubSource(
        repo=check_repo(repo),
        revision=check_hub_revision(revision or DEFAULT_REVISION),
        include=check_patterns(tuple(include), "include"),
        exclude=check_patterns(tuple(exclude), "exclude"),
        hub=hub,
    )
