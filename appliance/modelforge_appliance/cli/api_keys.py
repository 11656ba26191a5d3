"""``modelforge api-keys create|list|revoke``: keys for clients of the OpenAI-compatible API,
with their limits; ``modelforge usage``: what they used."""

from __future__ import annotations

import re
from dataclasses import replace

import click

from ..core.errors import ApiError
from ..identity import api_keys
from ..relay.limits import BY, usage_report
from ..store import audit
from .errors import refused
from .support import JSON_OPTION, Context, emit


@click.group("api-keys")
def api_keys_group() -> None:
    """Create, list and revoke client API keys (mfk_…; shown once, stored as digests)."""


@api_keys_group.command("create")
@click.option("--name", required=True, help="Who or what the key is for, e.g. 'chat frontend'.")
@click.option(
    "--deployments",
    metavar="A,B",
    help="Only these deployments (comma-separated); any other `model` gets 403 API_KEY_SCOPE, "
    "and GET /v1/models lists only these. Default: every deployment.",
)
@click.option(
    "--expires",
    metavar="WHEN",
    help="When the key stops working: a duration (90m, 12h, 30d, 2w) or a UTC date or time "
    "(2027-01-31, 2027-01-31T18:00). Default: never.",
)
@click.option(
    "--rpm", type=int, metavar="N", help="At most N requests a minute (429 RATE_LIMITED past it)."
)
@click.option(
    "--tokens-per-day",
    type=int,
    metavar="N",
    help="At most N prompt and completion tokens a UTC day, as the runtime counts them (429 "
    "QUOTA_EXCEEDED once reached).",
)
@JSON_OPTION
@click.pass_obj
def api_keys_create(
    obj: Context,
    name: str,
    deployments: str | None,
    expires: str | None,
    rpm: int | None,
    tokens_per_day: int | None,
    as_json: bool,
) -> None:
    """Mint an API key and print its secret once. Limits are optional; a key without them
    may call every deployment without limit."""
    store = obj.store()
    names = (
        None if deployments is None else [n.strip() for n in deployments.split(",") if n.strip()]
    )
    try:
        limits = api_keys.check_limits(names, rpm, tokens_per_day)
        if expires is not None:
            limits = replace(limits, expires_at=api_keys.parse_expiry(expires, store.clock.now()))
        view, secret = api_keys.create_api_key(store, name, audit.CLI_ACTOR, limits)
    except ApiError as exc:
        raise refused(exc) from None
    if as_json:
        emit(True, {**view, "secret": secret}, "")
        return
    click.echo(
        f"API key {view['key_id']} ({view['name']}){_limits_line(view)}:\n\n    {secret}\n\n"
        "Store it now: it is not shown again. Clients send it as "
        "'Authorization: Bearer <key>'."
    )


def _limits_line(view: dict) -> str:
    said = []
    if view["deployments"] is not None:
        said.append("only " + ", ".join(view["deployments"]))
    if view["rpm"] is not None:
        said.append(f"{view['rpm']} requests a minute")
    if view["tokens_per_day"] is not None:
        said.append(f"{view['tokens_per_day']} tokens a day")
    if view["expires_at"] is not None:
        said.append(f"until {view['expires_at']}")
    return f", {'; '.join(said)}" if said else ""


@api_keys_group.command("list")
@JSON_OPTION
@click.pass_obj
def api_keys_list(obj: Context, as_json: bool) -> None:
    """List API keys with their last use (never the secrets)."""
    rows = api_keys.list_api_keys(obj.store())
    lines = [f"{'KEY ID':18} {'NAME':24} {'CREATED':26} {'LAST USED':26} STATE"]
    for row in rows:
        state = f"revoked {row['revoked_at']}" if row["revoked_at"] else "active"
        used = row["last_used_at"] or "never"
        lines.append(
            f"{row['key_id']:18} {row['name'][:24]:24} {row['created_at']:26} {used:26} "
            f"{state}{_limits_line(row)}"
        )
    emit(as_json, {"api_keys": rows}, "\n".join(lines))


@api_keys_group.command("revoke")
@click.argument("key_id")
@JSON_OPTION
@click.pass_obj
def api_keys_revoke(obj: Context, key_id: str, as_json: bool) -> None:
    """Revoke an API key by its id (see `api-keys list`), for good."""
    try:
        view = api_keys.revoke_api_key(obj.store(), key_id, audit.CLI_ACTOR)
    except ApiError as exc:
        raise refused(exc) from None
    emit(as_json, view, f"Revoked API key {key_id} ({view['name']}); it stays refused.")


@click.command("usage")
@click.option(
    "--by",
    type=click.Choice(BY),
    default="key",
    show_default=True,
    help="Sum per API key, per deployment, or per UTC day.",
)
@click.option("--since", metavar="YYYY-MM-DD", help="From this UTC day on (default: all).")
@JSON_OPTION
@click.pass_obj
def usage_command(obj: Context, by: str, since: str | None, as_json: bool) -> None:
    """What each API key (or deployment, or day) used: requests, tokens, errors.

    Tokens are the prompt and completion tokens the runtimes reported. A running control
    plane writes its counts every few seconds; GET /api/v1/admin/usage is current to the
    second."""
    if since is not None and not re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", since):
        raise click.BadParameter("give a UTC date as YYYY-MM-DD", param_hint="--since")
    rows = usage_report(obj.store(), by, since)
    first = {"key": "KEY ID", "deployment": "DEPLOYMENT", "day": "DAY"}[by]
    field = "key_id" if by == "key" else by
    lines = [f"{first:18} {'NAME':20} {'REQUESTS':>9} {'PROMPT':>12} {'COMPLETION':>12} ERRORS"]
    for row in rows:
        lines.append(
            f"{row[field][:18]:18} {(row.get('name') or '')[:20]:20} {row['requests']:>9} "
            f"{row['prompt_tokens']:>12} {row['completion_tokens']:>12} {row['errors']}"
        )
    if not rows:
        lines.append("(nothing used yet)")
    emit(as_json, {"by": by, "since": since, "usage": rows}, "\n".join(lines))
