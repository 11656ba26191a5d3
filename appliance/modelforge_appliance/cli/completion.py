"""``modelforge completion bash|zsh|fish``: click's shell completion, with node names.

Completing a NODE reads the store read-only (node ids, with the hostname as help) and says
nothing when it cannot: a completion must never print errors into the operator's prompt,
create a store, or leave files behind in the state directory of another user.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

import click
from click.shell_completion import CompletionItem, get_completion_class

PROG = "modelforge"
COMPLETE_VAR = "_MODELFORGE_COMPLETE"
SHELLS = ("bash", "zsh", "fish")


def _node_rows(env_file: Path | None) -> list[tuple[str, str]]:
    from ..core.settings import load_settings
    from ..runtime.doctor import sqlite_file
    from .locate import venv_settings_file

    settings = load_settings(env_file=env_file or venv_settings_file())
    path = sqlite_file(settings.database_url)
    if path is None or not path.is_file():
        return []  # PostgreSQL: not worth a network round trip per key press
    if settings.state_dir.stat().st_uid != os.geteuid():
        return []
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1)
    try:
        return conn.execute(
            "SELECT node_id, hostname FROM node WHERE decommissioned_at IS NULL ORDER BY node_id"
        ).fetchall()
    finally:
        conn.close()


def complete_nodes(ctx: click.Context, param: click.Parameter, incomplete: str) -> list:
    """Node ids (help: the hostname) and hostnames that start with what was typed."""
    rows: list[tuple[str, str]] = []
    with contextlib.suppress(Exception):
        rows = _node_rows(ctx.find_root().params.get("env_file"))
    items = [CompletionItem(node_id, help=host) for node_id, host in rows]
    items += [CompletionItem(host, help=node_id) for node_id, host in rows]
    return [item for item in items if str(item.value).startswith(incomplete)]


@click.command("completion")
@click.argument("shell", type=click.Choice(SHELLS))
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print the shell completion script for bash, zsh or fish (node ids complete too).

    \b
    bash: modelforge completion bash > ~/.local/share/bash-completion/completions/modelforge
    zsh:  modelforge completion zsh > ~/.zfunc/_modelforge   (fpath+=~/.zfunc in ~/.zshrc)
    fish: modelforge completion fish > ~/.config/fish/completions/modelforge.fish
    """
    script = get_completion_class(shell)(ctx.find_root().command, {}, PROG, COMPLETE_VAR)
    click.echo(script.source())
