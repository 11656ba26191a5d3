"""``modelforge doctor``: run the host checks (runtime/doctor.py) and print them."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import click

from modelforge_contract import EXIT_CHECK_FAILED

from ..runtime.doctor import render_text, report, run_checks

log = logging.getLogger(__name__)


@click.command()
@click.option("--listen", help="HOST:PORT to check instead of MODELFORGE_LISTEN.")
@click.option(
    "--ca-cert",
    type=click.Path(path_type=Path, dir_okay=False),
    help="The private CA (PEM) agents trust (MODELFORGE_AGENT_CA_CERT_PATH): check that the "
    "https:// MODELFORGE_PUBLIC_API_ORIGIN verifies against it as agents on Python 3.13+ do.",
)
@click.option("--json", "as_json", is_flag=True, help='Print {"ok": …, "checks": […]} as JSON.')
@click.pass_obj
def doctor(obj: Any, listen: str | None, ca_cert: Path | None, as_json: bool) -> None:
    """Check this host before starting: Python, state directory, port, store, clock, settings,
    and with --ca-cert the TLS certificate agents will see.

    Exits 0 when every check passes and 1 when any fails; each failure says what to fix.
    """
    checks = run_checks(env_file=getattr(obj, "env_file", None), listen=listen, ca_cert=ca_cert)
    for check in checks:
        if not check.ok:
            log.info("doctor: %s failed: %s", check.name, check.detail)
    click.echo(json.dumps(report(checks), indent=2) if as_json else render_text(checks))
    if not all(check.ok for check in checks):
        sys.exit(EXIT_CHECK_FAILED)
