"""``modelforge enroll``: mint a single-use enrollment token from the host."""

from __future__ import annotations

import re

import click

from modelforge_contract import ENROLLMENT_EXPIRY_MAX_SECONDS, ENROLLMENT_EXPIRY_MIN_SECONDS

from .. import audit, enrollment
from .support import Context, emit

_DURATION = re.compile(r"(\d+)([smhd]?)")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int:
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None:
        raise click.BadParameter("use a duration such as 5m, 15m, 1h or 24h")
    seconds = int(match.group(1)) * _UNIT[match.group(2)]
    if not ENROLLMENT_EXPIRY_MIN_SECONDS <= seconds <= ENROLLMENT_EXPIRY_MAX_SECONDS:
        raise click.BadParameter("must be between 5m and 24h")
    return seconds


@click.command("enroll")
@click.option("--name", required=True, help="Display name of the node to be.")
@click.option("--expires", default="15m", show_default=True, help="Token lifetime, 5m to 24h.")
@click.option("--json", "as_json", is_flag=True, help="Print the mint response as JSON.")
@click.pass_obj
def enroll(obj: Context, name: str, expires: str, as_json: bool) -> None:
    """Mint a single-use enrollment token locked to the public API origin."""
    seconds = parse_duration(expires)
    if not 1 <= len(name) <= 120:
        raise click.BadParameter("must be 1 to 120 characters", param_hint="--name")
    store = obj.store()
    minted = enrollment.mint_enrollment_token(
        store,
        display_name=name,
        expires_in_seconds=seconds,
        api_origin=obj.settings.default_api_origin,
        actor=audit.CLI_ACTOR,
    )
    response = minted.response(store.clock.now())
    emit(
        as_json,
        response,
        f"Enrollment {response['enrollment_id']} for {name!r}, locked to {response['api_origin']},"
        f" expires {response['expires_at']}.\n\nToken (single use, shown once):\n\n"
        f"    {minted.token}\n\nSave as modelforge-node.env on the node:\n\n{response['env_file']}\n"
        f"Then start the agent (asks for the token without echo):\n\n    {response['start_command']}",
    )
