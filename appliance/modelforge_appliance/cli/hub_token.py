"""``modelforge hub-token set|show|clear``: the token ``models pull`` sends to the hub.

Never from argv (it would sit in shell history and ``ps``): asked without echo on a
terminal, otherwise one line read from stdin (``modelforge hub-token set < FILE``). It is
kept sealed with the state directory's work key (models/hub_token.py) and never printed
again: ``show`` says only whether one is set.
"""

from __future__ import annotations

import sys

import click

from modelforge_contract import EXIT_CHECK_FAILED

from ..core.errors import ApiError
from ..core.sealing import WorkKeys
from ..models import hub_token
from ..store import audit
from .errors import CliError, refused
from .support import JSON_OPTION, Context, emit

_UNCHANGED = "the hub token is unchanged"


def _read_token(as_json: bool) -> str:
    if sys.stdin.isatty():
        if as_json:
            raise CliError(
                f"--json does not ask questions; {_UNCHANGED}",
                "send the token as one line on stdin: modelforge hub-token set --json < FILE",
            )
        try:
            return click.prompt("Hub token (hf_…)", hide_input=True, err=True)
        except click.Abort:
            raise CliError(f"cancelled; {_UNCHANGED}", None, EXIT_CHECK_FAILED) from None
    line = sys.stdin.readline()
    if not line.strip():
        raise CliError(
            f"no token on stdin; {_UNCHANGED}",
            "send one line (modelforge hub-token set < FILE), or run this on a terminal",
        )
    return line.rstrip("\r\n")


def _when(view: dict) -> str:
    return f"set {view['set_at']} by {view['set_by']}" if view["set"] else "not set"


@click.group("hub-token")
def hub_token_group() -> None:
    """Set, show or clear the hub token models pull sends for gated and private repositories."""


@hub_token_group.command("set")
@JSON_OPTION
@click.pass_obj
def set_command(obj: Context, as_json: bool) -> None:
    """Set or replace the hub token (a read token from your Hugging Face account's settings).

    On a terminal it asks without echo; otherwise (and always with --json) it reads one
    line from stdin. It is kept sealed with the work key, sent only to the hub (never to a
    node), and never shown again.
    """
    store = obj.store()  # a missing store or the wrong user is refused before the prompt
    token = _read_token(as_json)
    try:
        view = hub_token.set_token(store, WorkKeys.of(obj.settings.state_dir), token,
                                   audit.CLI_ACTOR)  # fmt: skip
    except ApiError as exc:
        raise refused(exc) from None
    emit(as_json, view, "Hub token set; `modelforge models pull` sends it to the hub.")


@hub_token_group.command("show")
@JSON_OPTION
@click.pass_obj
def show_command(obj: Context, as_json: bool) -> None:
    """Whether a hub token is set, when and by whom (never the token)."""
    view = hub_token.token_view(obj.store())
    emit(as_json, view, f"Hub token: {_when(view)}.")


@hub_token_group.command("clear")
@JSON_OPTION
@click.pass_obj
def clear_command(obj: Context, as_json: bool) -> None:
    """Forget the hub token: pulls go to the hub without one."""
    cleared = hub_token.clear_token(obj.store(), audit.CLI_ACTOR)
    emit(
        as_json,
        {**hub_token.token_view(obj.store()), "cleared": cleared},
        "Hub token cleared." if cleared else "No hub token was set.",
    )
