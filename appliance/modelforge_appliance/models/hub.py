"""What a pull from a hub asks of it: the revision resolved to a commit, the files chosen, and
every refusal of the hub turned into one of ours with its next step (docs/architecture.md §10,
docs/models.md "Pulling from a hub").

Everything here talks to the hub through ``huggingface_hub`` (its ``HfApi.model_info`` for
the listing with each file's size, git blob id and LFS sha256, its ``get_hf_file_metadata``
for the access check, its URL and header builders), pointed at ``settings.hub_endpoint``
(``HF_ENDPOINT``). The token is passed to it explicitly, or ``False``: a token the host keeps
for other tools (``HF_TOKEN``, ``~/.cache/huggingface/token``) is never picked up.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, NoReturn, TypeVar

from modelforge_contract import __version__
from modelforge_contract.hub import (
    HUB_ACCESS_DENIED,
    HUB_DOWNLOAD_FAILED,
    HUB_NO_MATCHING_FILES,
    HUB_RATE_LIMITED,
    HUB_REPO_NOT_FOUND,
    HUB_REVISION_NOT_FOUND,
    HUB_TOKEN_REQUIRED,
    HUB_UNREACHABLE,
    HubSource,
)
from modelforge_contract.models import (
    MANIFEST_MAX_FILES,
    MODEL_SOURCE_INVALID,
    ManifestError,
    check_relative_path,
)

from ..core.errors import ApiError, Invalid

if TYPE_CHECKING:
    from huggingface_hub.errors import HfHubHTTPError


@functools.cache
def client() -> SimpleNamespace:
    """huggingface_hub and its HTTP client, imported when a pull first needs them: the import
    takes a fifth of a second, which the control plane's start (and every CLI command that
    does not pull) should not pay."""
    import httpx2
    from huggingface_hub import HfApi, errors
    from huggingface_hub import __version__ as version
    from huggingface_hub.file_download import get_hf_file_metadata, hf_hub_url, http_get
    from huggingface_hub.utils import build_hf_headers, filter_repo_objects

    return SimpleNamespace(
        HfApi=HfApi,
        errors=errors,
        version=version,
        transport_error=httpx2.TransportError,
        get_hf_file_metadata=get_hf_file_metadata,
        hf_hub_url=hf_hub_url,
        http_get=http_get,
        build_hf_headers=build_hf_headers,
        filter_repo_objects=filter_repo_objects,
    )


log = logging.getLogger(__name__)

LIBRARY = "modelforge"
_COMMIT = re.compile(r"[0-9a-f]{40}")
T = TypeVar("T")
SET_TOKEN = "modelforge hub-token set"


class HubError(ApiError):
    """The hub refused or failed; ``code`` says how (contract/hub.py)."""

    status = 502
    code = HUB_DOWNLOAD_FAILED
    next_step = "Pull again: what was downloaded is kept and the pull resumes from it."


@dataclass(frozen=True)
class HubFile:
    """One file of the resolved commit, as the hub lists it."""

    path: str
    size: int
    sha256: str | None  # an LFS file's sha256 (the hub's X-Linked-Etag)
    git_oid: str | None  # a file kept in git: its blob id (the hub's ETag)

    @property
    def key(self) -> str:
        """Its name in the staging area: by what the hub says its content is."""
        if self.sha256:
            return f"sha256-{self.sha256}"
        if self.git_oid:
            return f"git-{self.git_oid}"
        raise HubError(f"the hub lists {self.path} without a hash")


@dataclass(frozen=True)
class PullPlan:
    """A source resolved against the hub: the commit and the files to fetch from it."""

    source: HubSource
    endpoint: str
    commit: str
    files: tuple[HubFile, ...]
    gated: bool

    @property
    def url(self) -> str:
        """What the model's ``source`` records: the repository at its commit."""
        return f"hf://{self.source.repo}@{self.commit}"

    @property
    def bytes_total(self) -> int:
        return sum(f.size for f in self.files)

    def file_url(self, file: HubFile) -> str:
        return client().hf_hub_url(
            self.source.repo, file.path, revision=self.commit, endpoint=self.endpoint
        )


def request_headers(token: str | None) -> dict[str, str]:
    """The headers of a request to the hub: its user agent, and the token only when set."""
    return client().build_hf_headers(
        token=token or False, library_name=LIBRARY, library_version=__version__
    )


def plan_pull(endpoint: str, source: HubSource, token: str | None) -> PullPlan:
    """Resolve source's revision to a commit, list its files and choose the matching ones,
    then check with one file's metadata that this token may download them. Nothing is
    written; every refusal is an ApiError naming what to do."""
    api = client().HfApi(endpoint=endpoint, token=token or False, library_name=LIBRARY,
                library_version=__version__)  # fmt: skip
    info = asking(
        source,
        endpoint,
        token,
        lambda: api.model_info(
            source.repo, revision=source.revision, files_metadata=True, token=token or False
        ),
    )
    commit = info.sha or ""
    if not _COMMIT.fullmatch(commit):
        raise HubError(
            f"{endpoint} answered no commit for {source.url}",
            next_step="Check that HF_ENDPOINT points at a Hugging Face hub or a mirror of one.",
        )
    listed = [_hub_file(s, source) for s in info.siblings or ()]
    chosen = list(
        client().filter_repo_objects(
            listed,
            allow_patterns=list(source.include) or None,
            ignore_patterns=list(source.exclude) or None,
            key=lambda f: f.path,
        )
    )
    if not chosen:
        raise _no_match(source, commit, listed)
    if len(chosen) > MANIFEST_MAX_FILES:
        raise Invalid(
            f"{source.url} has {len(chosen)} matching files, more than {MANIFEST_MAX_FILES}",
            code=HUB_NO_MATCHING_FILES,
            next_step="Choose fewer with --include and --exclude.",
        )
    for file in chosen:
        _checked_path(file.path, source)
    plan = PullPlan(source, endpoint, commit, tuple(chosen), bool(info.gated))
    # Gating and privacy answer on the files, not on the listing: ask for one file's
    # metadata now, so a missing or refused token is said before anything is downloaded.
    asking(
        source,
        endpoint,
        token,
        lambda: client().get_hf_file_metadata(
            plan.file_url(chosen[0]),
            token=token or False,
            library_name=LIBRARY,
            library_version=__version__,
            endpoint=endpoint,
        ),
        gated=plan.gated,
    )
    log.info(
        "resolved %s to commit %s: %d of %d files, %d bytes (huggingface_hub %s)",
        source.url,
        commit,
        len(chosen),
        len(listed),
        plan.bytes_total,
        client().version,
    )
    return plan


def _hub_file(sibling, source: HubSource) -> HubFile:
    lfs = sibling.lfs
    size = lfs.size if lfs is not None else sibling.size
    if size is None:
        raise HubError(
            f"the hub lists {sibling.rfilename} of {source.url} without its size",
            next_step="Check that HF_ENDPOINT points at a Hugging Face hub or a mirror of one.",
        )
    return HubFile(
        path=sibling.rfilename,
        size=int(size),
        sha256=lfs.sha256 if lfs is not None else None,
        git_oid=sibling.blob_id,
    )


def _checked_path(path: str, source: HubSource) -> str:
    try:
        return check_relative_path(path)
    except ManifestError as exc:
        raise Invalid(
            f"{source.url}: file {path!r}: {exc}",
            code=MODEL_SOURCE_INVALID,
            next_step="Leave that file out with --exclude and pull again.",
        ) from None


def _no_match(source: HubSource, commit: str, listed: list[HubFile]) -> Invalid:
    shown = ", ".join(f.path for f in listed[:12]) + (" …" if len(listed) > 12 else "")
    wanted = " ".join(
        [
            *(f"--include {p!r}" for p in source.include),
            *(f"--exclude {p!r}" for p in source.exclude),
        ]
    )
    return Invalid(
        f"no file of {source.repo} at {commit[:12]} matches {wanted or 'the patterns'} "
        f"({len(listed)} files: {shown or 'none'})",
        code=HUB_NO_MATCHING_FILES,
        next_step="Match one of the files listed (patterns are globs; '*' crosses folders), "
        "e.g. --include '*Q4_K_M.gguf'.",
    )


# -- the hub's refusals, as ours --------------------------------------------------------


def asking(
    source: HubSource,
    endpoint: str,
    token: str | None,
    call: Callable[[], T],
    gated: bool = False,
) -> T:
    """call(), with whatever the hub (or the way to it) refused turned into an ApiError."""
    try:
        return call()
    except client().errors.HfHubHTTPError as exc:
        refuse(exc, source, endpoint, token, gated)
    except (client().transport_error, client().errors.OfflineModeIsEnabled) as exc:
        raise unreachable(exc, endpoint) from None


def unreachable(exc: Exception, endpoint: str) -> HubError:
    why = (
        "HF_HUB_OFFLINE is set"
        if isinstance(exc, client().errors.OfflineModeIsEnabled)
        else f"{type(exc).__name__}"
    )
    return HubError(
        f"cannot reach the hub at {endpoint} ({why})",
        code=HUB_UNREACHABLE,
        status=503,
        next_step=f"The control plane itself downloads: it must reach {endpoint} (or set "
        "HF_ENDPOINT to a mirror it reaches). Offline, copy the files to its host and bring "
        "them in with `modelforge models import NAME PATH`.",
    )


def refuse(
    exc: HfHubHTTPError, source: HubSource, endpoint: str, token: str | None, gated: bool
) -> NoReturn:
    """Raise the ApiError for a hub's HTTP refusal, saying which status it answered."""
    status = exc.response.status_code if exc.response is not None else 0
    page = f"{endpoint}/{source.repo}"
    errors = client().errors
    if isinstance(exc, errors.RevisionNotFoundError):
        raise Invalid(
            f"{source.repo} has no revision {source.revision!r} (the hub answered {status})",
            code=HUB_REVISION_NOT_FOUND,
            next_step=f"Name a branch, tag or commit of {page} (or leave @REVISION out for main).",
        ) from None
    if isinstance(exc, errors.GatedRepoError) or (status in (401, 403) and gated):
        raise _gated(status, source, page, token) from None
    if isinstance(exc, errors.RemoteEntryNotFoundError):
        raise HubError(
            f"{page} lists a file it does not serve (the hub answered {status})",
            next_step="Pull again; if it persists, the repository changed meanwhile: pull "
            "its new commit.",
        ) from None
    if isinstance(exc, errors.RepositoryNotFoundError):
        private = (
            "the token set may not read it, if it is private"
            if token
            else f"if it is private, set a token that may read it: {SET_TOKEN}"
        )
        raise Invalid(
            f"the hub has no repository {source.repo} it will show "
            f"{'this token' if token else 'without a token'} (it answered {status})",
            code=HUB_REPO_NOT_FOUND,
            next_step=f"Check the name at {page} (ORG/REPO, as in its URL); {private}.",
        ) from None
    if status == 401:
        raise Invalid(
            f"the hub refused the token set (it answered 401 for {source.repo})",
            code=HUB_TOKEN_REQUIRED,
            next_step=f"Set a valid token: {SET_TOKEN} (a read token from your hub account's "
            "settings).",
        ) from None
    if status == 403:
        raise Invalid(
            f"the token set may not read {source.repo} (the hub answered 403)",
            code=HUB_ACCESS_DENIED,
            next_step=f"Set a token with read access to it: {SET_TOKEN}.",
        ) from None
    if status == 429:
        wait = _retry_after(exc)
        raise HubError(
            f"the hub is limiting this control plane's requests (it answered 429 for "
            f"{source.repo})",
            code=HUB_RATE_LIMITED,
            status=503,
            next_step=f"Wait{f' {wait} s' if wait else ''} and pull again (it resumes); a "
            f"token gets higher limits: {SET_TOKEN}.",
            extra={"retry_after_seconds": wait} if wait else None,
        ) from None
    raise HubError(
        f"the hub answered {status} for {source.repo}"
        + (f" ({exc.response.headers.get('X-Error-Code')})" if _error_code(exc) else ""),
        next_step="Pull again later (it resumes); if it persists, check the hub's status or "
        "your HF_ENDPOINT mirror.",
    ) from None


def _gated(status: int, source: HubSource, page: str, token: str | None) -> Invalid:
    if status == 403 or token:
        return Invalid(
            f"{source.repo} is gated and the token set has no access to it yet (the hub "
            f"answered {status})",
            code=HUB_ACCESS_DENIED,
            next_step=f"Sign in to {page} with the token's account and accept its conditions "
            "(some repositories wait for their authors' approval), then pull again.",
        )
    return Invalid(
        f"{source.repo} is gated: the hub answers only with a token (it answered {status})",
        code=HUB_TOKEN_REQUIRED,
        next_step=f"Accept its conditions at {page} with your hub account, then give this "
        f"control plane a read token of that account: {SET_TOKEN}; then pull again.",
    )


def _error_code(exc: HfHubHTTPError) -> str | None:
    return exc.response.headers.get("X-Error-Code") if exc.response is not None else None


def _retry_after(exc: HfHubHTTPError) -> int | None:
    raw = exc.response.headers.get("Retry-After") if exc.response is not None else None
    return int(raw) if raw and raw.isdigit() and 0 < int(raw) <= 86400 else None
