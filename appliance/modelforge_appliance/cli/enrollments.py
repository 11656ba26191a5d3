"""``modelforge enroll`` and ``modelforge enrollments list|revoke``: single-use tokens."""

from __future__ import annotations

import textwrap

import click

from modelforge_contract import (
    ACCELERATOR_MODES,
    ENROLLMENT_EXPIRY_MAX_SECONDS,
    ENROLLMENT_EXPIRY_MIN_SECONDS,
)

from ..core.errors import NotFound
from ..identity import enrollment, join_commands
from ..runtime import serving
from ..store import audit
from .errors import CliError
from .support import JSON_OPTION, Context, duration_seconds, emit


def parse_duration(text: str, option: str = "--expires") -> int:
    return duration_seconds(
        text,
        option,
        ENROLLMENT_EXPIRY_MIN_SECONDS,
        ENROLLMENT_EXPIRY_MAX_SECONDS,
        "5m, 15m, 1h or 24h",
    )


@click.command("enroll")
@click.option("--name", required=True, help="Display name of the node to be.")
@click.option("--expires", default="15m", show_default=True, help="Token lifetime, 5m to 24h.")
@click.option(
    "--accelerator",
    type=click.Choice(ACCELERATOR_MODES),
    default=enrollment.DEFAULT_ACCELERATOR_MODE,
    show_default=True,
    help="The mode the join commands and the env file set: nvidia (require a GPU), cpu, or "
    "auto. The node reports its own when it enrolls.",
)
@click.option(
    "--origin",
    metavar="URL",
    help="Lock the token to this API origin. Default: MODELFORGE_PUBLIC_API_ORIGIN, else the "
    "address the running control plane serves.",
)
@JSON_OPTION
@click.pass_obj
def enroll(
    obj: Context, name: str, expires: str, accelerator: str, origin: str | None, as_json: bool
) -> None:
    """Mint a single-use enrollment token and print the command that joins a node with it."""
    seconds = parse_duration(expires)
    if not 1 <= len(name) <= 120:
        raise click.BadParameter("must be 1 to 120 characters", param_hint="--name")
    locked = serving.token_origin(obj.settings, origin)
    store = obj.store()
    minted = enrollment.mint_enrollment_token(
        store,
        display_name=name,
        expires_in_seconds=seconds,
        api_origin=locked.origin,
        actor=audit.CLI_ACTOR,
        accelerator_mode=accelerator,
    )
    response = minted.response(store.clock.now())
    for warning in response["warnings"]:
        click.echo(f"modelforge: warning: {warning}", err=True)
    emit(
        as_json,
        response,
        f"Enrollment {response['enrollment_id']} for {name!r}, locked to {response['api_origin']}"
        f" (from {locked.source}), expires {response['expires_at']}.\n\n"
        f"Token (single use, shown once):\n\n    {minted.token}\n\n"
        "Join the node with one command; it asks for the token without echo:\n\n"
        f"{join_commands.describe(response['join_commands'])}\n"
        "The node is ready only while its Runtime Worker answers beside the agent "
        "(docs/work.md). From a checkout, start it first:\n\n"
        f"    {join_commands.checkout_worker_command(accelerator)}\n\n"
        f"For the compose files (docs/node-agent.md), save this as {response['env_file_name']} "
        "beside them (no secret in it):\n\n"
        + textwrap.indent(response["env_file"].rstrip("\n"), "    "),
    )


@click.group("enrollments")
def enrollments_group() -> None:
    """List enrollment tokens (never the tokens themselves) and revoke unused ones."""


_STATES = ("pending", "consumed", "expired", "revoked")


@enrollments_group.command("list")
@click.option(
    "--state", "states", multiple=True, type=click.Choice(_STATES), help="Only these states."
)
@JSON_OPTION
@click.pass_obj
def enrollments_list(obj: Context, states: tuple[str, ...], as_json: bool) -> None:
    """Every enrollment, newest first: pending, consumed, expired or revoked."""
    rows = enrollment.list_enrollments(obj.store())
    if states:
        rows = [row for row in rows if row["state"] in states]
    lines = [f"{'ENROLLMENT ID':18} {'NAME':24} {'STATE':9} {'EXPIRES':26} NODE / ORIGIN"]
    for row in rows:
        tail = row["node_id"] or row["api_origin"]
        lines.append(
            f"{row['enrollment_id']:18} {row['display_name'][:24]:24} {row['state']:9} "
            f"{row['expires_at']:26} {tail}"
        )
    emit(as_json, {"enrollments": rows}, "\n".join(lines))


@enrollments_group.command("revoke")
@click.argument("enrollment_id")
@JSON_OPTION
@click.pass_obj
def enrollments_revoke(obj: Context, enrollment_id: str, as_json: bool) -> None:
    """Revoke an unused enrollment token (a used one: revoke the node's credential)."""
    store = obj.store()
    known = [row["enrollment_id"] for row in enrollment.list_enrollments(store)]
    matches = [known_id for known_id in known if known_id.startswith(enrollment_id.lower())]
    if enrollment_id in known:
        matches = [enrollment_id]
    if not matches:
        raise NotFound(
            f"no enrollment {enrollment_id}", next_step="see `modelforge enrollments list`"
        )
    if len(matches) > 1:
        raise CliError(
            f"{enrollment_id!r} names {len(matches)} enrollments: {', '.join(matches[:5])}",
            "give more of the enrollment id",
        )
    row = enrollment.revoke_enrollment(store, matches[0], audit.CLI_ACTOR)
    emit(as_json, row, f"Enrollment {row['enrollment_id']} is {row['state']}.")
