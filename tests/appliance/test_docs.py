"""docs/api.md documents every route and every error code the contract defines."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import modelforge_contract as contract
from modelforge_appliance.runtime.app import make_app
from tests.harness.control_plane import make_settings

ROOT = Path(__file__).resolve().parents[2]


def test_every_route_is_documented(tmp_path):
    text = (ROOT / "docs" / "api.md").read_text()
    app = make_app(make_settings(tmp_path), store=_NoStore())
    for route in app.routes:
        documented = re.sub(r"<(\w+)(?::[^>]*)?>", r"{\1}", route.rule)
        assert f"`{route.method} {documented}`" in text, f"{route.method} {route.rule}"


def test_every_error_code_is_documented():
    text = (ROOT / "docs" / "api.md").read_text()
    codes = {
        value
        for name, value in vars(contract).items()
        if isinstance(value, str) and name.isupper() and value == name and "_" in name
    }
    codes -= {"TOO_OLD", "TOO_NEW", "COMPATIBLE", "UNKNOWN"}  # answers, not error codes
    codes -= {c for c in codes if c.startswith(("PATH_", "HEADER_", "KIND_"))}
    assert "CREDENTIAL_REVOKED" in codes
    missing = sorted(code for code in codes if f"`{code}`" not in text)
    assert missing == []


class _NoStore:
    """make_app only keeps the store for handlers; listing routes calls none."""

    clock = None


# -- every command, subcommand and flag the documentation names exists ------------------

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
_INLINE = re.compile(r"`([^`\n]+)`")
_SEPARATORS = re.compile(r"\s*(?:&&|\|\||;|\$\(|\|(?=\s))\s*")
# docker run options that take a value (the image follows them)
_DOCKER_VALUE_OPTIONS = {
    "-v", "-e", "-u", "-w", "--user", "--name", "--env-file", "--hostname", "--gpus",
    "--network", "--restart", "--tmpfs", "--entrypoint", "--volume", "--env",
    "--cap-drop", "--cap-add", "--security-opt",
}  # fmt: skip


def _programs():
    from modelforge_appliance.cli.main import main as appliance
    from modelforge_node_agent.main import main as agent
    from modelforge_release.cli import main as release
    from modelforge_worker.server import main as worker

    return {
        "modelforge": appliance,
        "mf": appliance,  # the docs' helper that runs modelforge as the service
        "modelforge.pyz": appliance,
        "modelforge_appliance.cli": appliance,
        "modelforge-node-agent": agent,
        "modelforge-node-agent.pyz": agent,
        "modelforge_node_agent.main": agent,
        "modelforge-release": release,
        "modelforge-runtime-worker": worker,
        "modelforge-runtime-worker.pyz": worker,
        "modelforge_worker": worker,
    }


# Tables that quote what a program prints (a message, then what to do), not commands.
_QUOTING_HEADERS = {"message", "log line", "error"}


def _prose_without_quoted_output(prose: str) -> str:
    kept, quoting = [], False
    for line in prose.splitlines():
        if line.startswith("|"):
            first = line.strip("|").split("|")[0].strip().lower()
            quoting = quoting or first in _QUOTING_HEADERS
            if quoting:
                continue
        else:
            quoting = False
        kept.append(line)
    return "\n".join(kept)


def _snippets(text: str) -> list[str]:
    fenced = _FENCE.findall(text)
    prose = _prose_without_quoted_output(_FENCE.sub("", text))
    lines = []
    for block in fenced:
        lines += block.replace("\\\n", " ").splitlines()
    # Two or more spaces start an aligned comment or description (README's command list).
    return [re.split(r"\s{2,}", line.strip())[0] for line in lines] + _INLINE.findall(prose)


def _command_words(words: list[str]) -> tuple[str, list[str]] | None:
    """(program, its arguments) when the words start one of our programs, else None."""
    while words and (words[0] in ("sudo", "exec", "env") or re.fullmatch(r"[A-Z_]+=\S*", words[0])):
        words = words[1:]
    if words[:2] == ["docker", "exec"]:
        words = [w for w in words[2:] if not w.startswith("-")][1:]
    elif words[:2] == ["docker", "run"]:
        rest, i = words[2:], 0
        while i < len(rest) and rest[i].startswith("-"):
            i += 2 if rest[i] in _DOCKER_VALUE_OPTIONS else 1
        words = rest[i + 1 :]  # past the image
    if words and re.fullmatch(r"(\S*/)?python3(\.\d+)?", words[0]):
        words = [w for w in words[1:] if w not in ("-I", "-S", "-E")]
        if words[:1] == ["-m"]:
            words = words[1:]
    if not words:
        return None
    program = words[0].rsplit("/", 1)[-1]
    return (program, words[1:]) if program in _programs() else None


def _check(
    command,
    args: list[str],
    path: str,
    problems: list[str],
    params: set[str],
    named: set[str] | None = None,
) -> None:
    """Walk args through command's subcommands; every option must be one it takes. The
    command paths walked ("modelforge nodes show") are added to ``named``."""
    import click

    if named is not None:
        named.add(path)
    params = params | {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    params |= {"-h", "--help", "--version"}
    for index, word in enumerate(args):
        word = word.strip("[]").replace("\\|", "|")
        if not word or word in ("…", "...") or word.startswith(("#", ">", "<", "2>")):
            return
        if word.startswith("-") and len(word) > 1:
            if word.split("=")[0] not in params:
                problems.append(f"{path}: {word} is not an option")
            continue
        if isinstance(command, click.Group):
            names = word.split("|")
            if all(re.fullmatch(r"[a-z][a-z-]*", n) for n in names):
                for name in names:
                    sub = _subcommands(command).get(name)
                    if sub is None:
                        problems.append(f"{path}: no command {name!r}")
                    else:
                        where = f"{path} {name}"
                        _check(sub, args[index + 1 :], where, problems, params, named)
                return


def _subcommands(group) -> dict:
    """A group's commands by name, loading those it loads lazily (the root of modelforge)."""
    import click

    ctx = click.Context(group)
    return {name: group.get_command(ctx, name) for name in group.list_commands(ctx)}


def _documented_commands(docs: list[Path]) -> tuple[int, list[str], set[str]]:
    """(commands seen, problems, command paths named) over the docs' snippets."""
    problems: list[str] = []
    named: set[str] = set()
    seen = 0
    for doc in docs:
        for line in _snippets(doc.read_text()):
            for part in _SEPARATORS.split(line.strip().lstrip("$ ")):
                try:
                    words = shlex.split(part, comments=True)
                except ValueError:
                    words = part.split()
                found = _command_words(words)
                if found is None:
                    continue
                program, args = found
                seen += 1
                where = f"{doc.relative_to(ROOT)}: {program}"
                paths: set[str] = set()
                _check(_programs()[program], args, where, problems, set(), paths)
                prefix = f"{doc.relative_to(ROOT)}: "
                named |= {p.removeprefix(prefix) for p in paths}
    return seen, problems, named


def test_every_command_and_flag_in_the_docs_exists():
    seen, problems, _ = _documented_commands(DOCS)
    assert seen > 100  # the extraction found the documented commands
    assert problems == []


def _command_paths(command, path: str) -> set[str]:
    """Every command under ``command`` that does something ("modelforge nodes show")."""
    import click

    if not isinstance(command, click.Group):
        return {path}
    found = set() if not command.invoke_without_command else {path}
    for name, sub in _subcommands(command).items():
        found |= _command_paths(sub, f"{path} {name}")
    return found


def test_every_command_is_in_the_docs():
    """The other way round: each command of each program (admin-password, save-finality,
    restore-finality, work, join, status… whichever part added it) is named in README.md or
    docs/ as a command line, and every `modelforge` command in docs/cli.md."""
    _, _, named = _documented_commands(DOCS)
    programs = {
        "modelforge": "modelforge",
        "modelforge-node-agent": "modelforge-node-agent",
        "modelforge-release": "modelforge-release",
        "modelforge-runtime-worker": "modelforge-runtime-worker",
    }
    for program, shown in programs.items():
        missing = sorted(_command_paths(_programs()[program], shown) - named)
        assert missing == [], f"commands no doc names: {missing}"
    _, _, in_cli_md = _documented_commands([ROOT / "docs" / "cli.md"])
    missing = sorted(_command_paths(_programs()["modelforge"], "modelforge") - in_cli_md)
    assert missing == [], f"docs/cli.md does not name: {missing}"


def test_every_command_of_every_program_takes_dash_h():
    """The README's promise: every command takes -h (modelforge-release -h once failed)."""
    from click.testing import CliRunner

    # A group's callback runs before a subcommand's -h, and modelforge's sets the process's
    # umask to 077: put it back, or every later test in this process makes private folders.
    umask = os.umask(0o022)
    os.umask(umask)
    try:
        for program in ("modelforge", "modelforge-node-agent", "modelforge-release",
                        "modelforge-runtime-worker"):  # fmt: skip
            root = _programs()[program]
            for path in sorted(_command_paths(root, program) | {program}):
                words = path.split()[1:]
                result = CliRunner().invoke(root, [*words, "-h"], prog_name=program)
                assert result.exit_code == 0, f"{path} -h: {result.output}"
                assert result.output.startswith("Usage: "), path
    finally:
        os.umask(umask)


def test_the_docs_command_check_catches_a_wrong_command_or_flag():
    problems: list[str] = []
    appliance = _programs()["modelforge"]
    _check(appliance, ["nodes", "shwo", "NODE"], "x", problems, set())
    _check(appliance, ["nodes", "show", "NODE", "--jsn"], "x", problems, set())
    _check(appliance, ["admin-token", "create|list|remove"], "x", problems, set())
    assert len(problems) == 3, problems
    named: set[str] = set()
    _check(appliance, ["nodes", "show|rename", "NODE"], "modelforge", [], set(), named)
    assert named == {
        "modelforge",
        "modelforge nodes",
        "modelforge nodes show",
        "modelforge nodes rename",
    }
    assert "modelforge admin-password set" in _command_paths(appliance, "modelforge")
    assert "is" not in _snippets("| message | what |\n|---|---|\n| `modelforge.pyz is` | x |\n")
    assert _command_words(["docker", "exec", "cp", "modelforge", "init"]) == (
        "modelforge",
        ["init"],
    )
    assert (
        _command_words(shlex.split("sudo python3.11 /opt/modelforge/modelforge.pyz serve"))[0]
        == "modelforge.pyz"
    )


# -- every exit code in the tables is one the code uses, and every one is in a table ------


def _exit_tables() -> dict[str, set[int]]:
    """{doc: codes} from tables whose first column is an exit status (not HTTP statuses)."""
    found: dict[str, set[int]] = {}
    for doc in DOCS:
        rows = [line for line in doc.read_text().splitlines() if line.startswith("|")]
        header = None
        for row in rows:
            cells = [cell.strip().strip("`").lower() for cell in row.strip("|").split("|")]
            if cells[0] in ("exit", "status", "exit status"):
                header = cells
                continue
            if header is not None and re.fullmatch(r"\d+", cells[0]) and int(cells[0]) < 100:
                found.setdefault(str(doc.relative_to(ROOT)), set()).add(int(cells[0]))
    return found


def _codes_the_code_uses() -> set[int]:
    values = {
        name: value
        for name, value in vars(contract).items()
        if name.startswith("EXIT_") and isinstance(value, int)
    }
    used: set[int] = set()
    for part in ("appliance", "agent", "release"):
        for source in (ROOT / part).rglob("*.py"):
            text = source.read_text()
            used |= {value for name, value in values.items() if re.search(rf"\b{name}\b", text)}
            used |= {int(n) for n in re.findall(r"EXIT_\w+ = (\d+)", text)}
    return used


def test_every_exit_code_in_the_tables_is_one_the_code_uses():
    tables = _exit_tables()
    assert {"README.md", "docs/cli.md", "docs/node-agent.md"} <= set(tables), tables
    used = _codes_the_code_uses()
    for doc, codes in tables.items():
        assert codes <= used, (doc, codes - used)
    documented = set().union(*tables.values())
    defined = {v for k, v in vars(contract).items() if k.startswith("EXIT_") and isinstance(v, int)}
    assert defined <= documented, defined - documented


def test_readme_shows_console_screenshots_that_exist():
    text = (ROOT / "README.md").read_text()
    images = re.findall(r"!\[[^\]]*\]\((docs/images/[^)]+\.png)\)", text)
    assert len(images) >= 2, images
    for image in images:
        data = (ROOT / image).read_bytes()
        assert data.startswith(b"\x89PNG"), image
    assert "docs/console.md" in text


def test_console_settings_and_routes_are_in_the_console_doc():
    text = (ROOT / "docs" / "console.md").read_text()
    for name in (
        "MODELFORGE_CONSOLE_SESSION_IDLE_SECONDS",
        "MODELFORGE_CONSOLE_SESSION_MAX_SECONDS",
        "MODELFORGE_TELEMETRY_RETENTION_SECONDS",
        "MODELFORGE_RELEASE_MANIFEST",
        "modelforge admin-password set",
        "--no-build --pull never",
    ):
        assert name in text, name
