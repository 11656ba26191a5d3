"""The ``modelforge`` command line (click): the root group, its one error handler, and the one
place that registers every command module on it. Exit codes: see cli/errors.py and docs/cli.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from modelforge_contract import PROTOCOL_VERSION, __version__

from ..core.settings import ConfigError
from ..store.backup import RestoreRefused
from ..store.database import StoreVersionError
from ..store.statelock import StateBusy
from .admin_password import admin_password
from .admin_tokens import admin_token
from .api_keys import api_keys_group
from .audit import audit_command
from .completion import completion
from .deployments import deploy_command, deployments_group, undeploy_command
from .doctor import doctor
from .enrollments import enroll, enrollments_group
from .errors import report
from .models import models_group
from .nodes import alerts_command, nodes_group
from .serve import init, serve
from .store import backup_command, restore_command, restore_finality_command, save_finality_command
from .support import Context, fail
from .work import work_group


class Group(click.Group):
    """The one error handler: every failure is one line with a next step and its exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (ConfigError, StoreVersionError, RestoreRefused, StateBusy) as exc:
            fail(str(exc))
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:  # everything else: one line, the trace only with --debug
            obj = ctx.obj if isinstance(ctx.obj, Context) else None
            report(
                exc,
                debug=bool(obj and obj.debug),
                database_url=obj.database_url if obj else None,
            )


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(
    __version__, message=f"modelforge %(version)s (agent protocol {PROTOCOL_VERSION})"
)
@click.option(
    "--env-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Read MODELFORGE_* settings from this KEY=VALUE file; the environment wins on "
    "conflicts. Default: the settings scripts/run left in this virtualenv, if any.",
)
@click.option("--debug", is_flag=True, help="On failure, show the Python traceback too.")
@click.pass_context
def main(ctx: click.Context, env_file: Path | None, debug: bool) -> None:
    """ModelForge control plane: enrollment, node credentials, liveness and the console.

    Settings come from MODELFORGE_* environment variables (docs/configuration.md).
    Exit codes: 0 ok, 1 the answer is no (not ready, a check failed, alerts, declined),
    2 usage or configuration, 7 not found, 8 store unreachable, 9 the system refused
    (disk full, I/O error), 70 internal error.
    """
    # Everything this program writes (store, WAL, backups, lock) is for its own user only.
    os.umask(0o077)
    ctx.obj = Context(env_file, debug)
    ctx.call_on_close(ctx.obj.close)  # the state lock is held until the command ends


for command in (
    init,
    serve,
    admin_password,
    admin_token,
    api_keys_group,
    enroll,
    enrollments_group,
    nodes_group,
    alerts_command,
    audit_command,
    backup_command,
    restore_command,
    save_finality_command,
    restore_finality_command,
    doctor,
    completion,
    work_group,
    models_group,
    deploy_command,
    deployments_group,
    undeploy_command,
):
    main.add_command(command)

__all__ = ["main"]

if __name__ == "__main__":
    main()
