"""The ``modelforge-release`` command line (click).

Exit codes: 0 ok; 1 a check failed (a file, an image, a container: named on stderr) or a
build step failed; 2 usage, a malformed or unsafe SHA256SUMS line, or a template problem.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path

import click

from modelforge_contract import EXIT_USAGE, __version__
from modelforge_contract.manifest import (
    IMAGE_NAMES,
    SOURCE_URL,
    ManifestError,
    is_version,
    parse_manifest,
)

from .names import RELEASE_PRINCIPAL
from .sums import (
    SumsError,
    check_version,
    compute_entries,
    names_relative_to,
    order_by_template,
    read_template,
    write_sums,
)
from .verify import check_sums

EXIT_FAILED = 1
PROG = "modelforge-release"

log = logging.getLogger(__name__)


def _fail(message: str, code: int) -> None:
    click.echo(f"{PROG}: {message}", err=True)
    sys.exit(code)


def _need_module(module: str, command: str) -> None:
    """Name the missing extra in one line rather than an ImportError traceback."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        _fail(
            f"{command} needs {module}, from the release extra: "
            "pip install -e '.[release]' (scripts/test installs it)",
            EXIT_USAGE,
        )


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name=PROG)
@click.option("-v", "--verbose", is_flag=True, help="Log each file hashed, with its timing.")
def main(verbose: bool) -> None:
    """Release tooling: build the images, bundle a release, and verify it (docs/release.md)."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(levelname)s %(name)s: %(message)s",
    )


@main.command()
@click.option(
    "--template",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="SHA256SUMS.template: the release file names, in the order they are listed.",
)
@click.option("--version", "release_version", help="Fills {version} in the template.")
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("SHA256SUMS"),
    show_default=True,
    help="Where to write; names in it are relative to its directory.",
)
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
def sums(
    template: Path | None, release_version: str | None, output: Path, files: tuple[Path, ...]
) -> None:
    """Write SHA256SUMS for FILES in GNU coreutils format (sha256sum -c reads it).

    Without --template the lines follow the order of FILES; with it, the template's order,
    and FILES must be exactly the files it lists.
    """
    try:
        if release_version is not None:
            if template is None:
                raise SumsError("--version only fills a --template")
            check_version(release_version)
        named = names_relative_to(output.parent, files)
        if output.name in {name for name, _ in named}:
            raise SumsError(f"{output} cannot list itself")
        if template is not None:
            named = order_by_template(named, read_template(template, release_version))
    except SumsError as exc:
        _fail(str(exc), EXIT_USAGE)
    try:
        # Every file is hashed before the output is opened: a missing input leaves any
        # previous SHA256SUMS untouched.
        entries = compute_entries(named, progress=sys.stderr)
    except OSError as exc:
        _fail(f"cannot read {exc.filename}: {exc.strerror or exc}", EXIT_FAILED)
    write_sums(output, entries)


@main.command("verify-sums")
@click.option(
    "--sums",
    "sums_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=Path("SHA256SUMS"),
    show_default=True,
    help="The SHA256SUMS file; names in it are read relative to its directory.",
)
@click.option("--ignore-missing", is_flag=True, help="Skip listed files that do not exist.")
@click.option("--quiet", is_flag=True, help="Print nothing for files that match.")
def verify_sums(sums_path: Path, ignore_missing: bool, quiet: bool) -> None:
    """Check every file SHA256SUMS lists, like sha256sum -c.

    Prints NAME: OK, NAME: FAILED or NAME: FAILED open or read, then sha256sum's warnings.
    Exit 1 on any failure, 2 on a malformed or unsafe line (nothing is read then).
    """
    try:
        outcome = check_sums(
            sums_path,
            ignore_missing=ignore_missing,
            quiet=quiet,
            out=sys.stdout,
            err=sys.stderr,
            progress=sys.stderr,
            prog=PROG,
        )
    except SumsError as exc:
        _fail(str(exc), EXIT_USAGE)
    if not outcome.ok:
        sys.exit(EXIT_FAILED)


# -- images, bundle and the image verifiers ---------------------------------------------------


def _checkout() -> Path | None:
    """The ModelForge checkout this program runs from, if it runs from one."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "packaging" / "images" / "debian-packages.lock").is_file() else None


def _source_option(function):
    return click.option(
        "--source",
        type=click.Path(exists=True, file_okay=False, path_type=Path),
        default=_checkout,
        show_default="the checkout this program runs from",
        help="ModelForge checkout to build from.",
    )(function)


def _emit(as_json: bool, document: dict, lines: list[str]) -> None:
    if as_json:
        click.echo(json.dumps(document, indent=2, sort_keys=True))
    else:
        for line in lines:
            click.echo(line)


_CORE = re.compile(r"[0-9]+\.[0-9]+\.[0-9]+")
_PROJECT_VERSION = re.compile(r'^version\s*=\s*"([^"]+)"', re.M)


def _version_of_source(source: Path, asked: str | None) -> str:
    """The release version for images built from ``source``: ``asked``, when it is the
    source's own version or a pre-release/build of it; the source's version when not given.
    Images labelled 1.3.0 that hold 0.1.0's code would pass every check and then be refused
    by a console that knows better."""
    try:
        found = _PROJECT_VERSION.search((source / "pyproject.toml").read_text(encoding="utf-8"))
    except OSError as exc:
        _fail(f"cannot read {source / 'pyproject.toml'}: {exc.strerror or exc}", EXIT_USAGE)
    own = found.group(1) if found else __version__
    if asked is None:
        return own
    _check_release_version(asked)
    core, own_core = _CORE.match(asked), _CORE.match(own)
    if core is None or own_core is None or core.group(0) != own_core.group(0):
        _fail(
            f"--version {asked} is not the version of the source ({own}, in "
            f"{source / 'pyproject.toml'}): the images would be labelled {asked} and hold "
            f"{own}'s code. Give --version {own} (or a pre-release of it, {own}-rc.1), or "
            "change the version in pyproject.toml first",
            EXIT_USAGE,
        )
    return asked


def _check_release_version(version: str) -> None:
    if not is_version(version):
        _fail(
            f"--version {version!r} is not a release version (e.g. 1.3.0 or 1.3.0-rc.1)", EXIT_USAGE
        )


@main.command()
@click.option(
    "--version",
    "release_version",
    help="Release version; every image is tagged <name>:VERSION [default: the source's "
    "version, from its pyproject.toml]. Its X.Y.Z must be the source's: a pre-release or "
    "build of it (0.1.0-rc.1) is fine, another release is refused.",
)
@_source_option
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=lambda: Path(
        os.environ.get("MODELFORGE_RELEASE_CACHE", Path.home() / ".cache" / "modelforge-release")
    ),
    show_default="$MODELFORGE_RELEASE_CACHE or ~/.cache/modelforge-release",
    help="Downloaded .deb files and wheels, each checked against its pinned SHA-256 on every use.",
)
@click.option(
    "--dist",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the pyz files go [default: SOURCE/dist].",
)
@click.option(
    "--revision", help="org.opencontainers.image.revision [default: the commit, -dirty if changed]."
)
@click.option(
    "--source-url",
    help="org.opencontainers.image.source, a URL [default: the git remote 'origin' when it is "
    "a URL; otherwise the label is left out].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the images built, as JSON.")
def images(
    release_version: str,
    source: Path | None,
    cache_dir: Path,
    dist: Path | None,
    revision: str | None,
    source_url: str | None,
    as_json: bool,
) -> None:
    """Build the four images into the local dockerd, tagged <name>:VERSION.

    Root filesystems come from the Debian packages pinned in
    packaging/images/debian-packages.lock and the hash-locked wheels in
    packaging/requirements-*.txt; no image is pulled. The layers are the same byte for byte
    on every build of the same commit (mtimes from SOURCE_DATE_EPOCH, default: the commit
    time). Also writes modelforge-x86_64.pyz, modelforge-aarch64.pyz,
    modelforge-node-agent.pyz and modelforge-runtime-worker.pyz into --dist.
    """
    from .build import build_images, load_images
    from .debian import DebianError
    from .dockerd import DaemonError, connect
    from .images import BuildContext, default_epoch, default_revision, default_source_url

    if source is None:
        _fail("not running from a ModelForge checkout: give --source", EXIT_USAGE)
    release_version = _version_of_source(source, release_version)
    if source_url is not None and not SOURCE_URL.fullmatch(source_url):
        _fail(
            f"--source-url {source_url!r} is not a URL (https://…); leave it out to use the "
            "git remote 'origin', or no source label when that is not a URL",
            EXIT_USAGE,
        )
    epoch_text = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch_text is not None and not epoch_text.isdigit():
        _fail(f"SOURCE_DATE_EPOCH={epoch_text!r} is not a number of seconds", EXIT_USAGE)
    try:
        client = connect()
        ctx = BuildContext(
            source=source,
            version=release_version,
            revision=revision or default_revision(source),
            source_url=source_url or default_source_url(source),
            epoch=int(epoch_text) if epoch_text else default_epoch(source),
            cache_dir=cache_dir.absolute(),
            work_dir=source / "build" / "images",
            dist=(dist or source / "dist").absolute(),
            progress=sys.stderr,
        )
        built = build_images(ctx)
        loaded = load_images(client, ctx, built)
    except (DebianError, DaemonError, OSError) as exc:
        _fail(str(exc), EXIT_FAILED)
    document = {
        "version": release_version,
        "images": loaded,
        "seconds": {step: round(value, 3) for step, value in ctx.timings.items()},
    }
    _emit(as_json, document, [f"{item['tag']} {item['image_id']}" for item in loaded.values()])


@main.command()
@click.option(
    "--version",
    "release_version",
    default=__version__,
    show_default=True,
    help="Release version of the images in dockerd (modelforge-release images tagged them).",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Release directory to write.",
)
@click.option(
    "--dist",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Where modelforge-release images put the pyz files [default: the checkout's dist/].",
)
@click.option(
    "--template",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="SHA256SUMS.template [default: the checkout's].",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the files and images written, as JSON."
)
@_source_option
def bundle(
    release_version: str,
    out: Path,
    dist: Path | None,
    template: Path | None,
    source: Path | None,
    as_json: bool,
) -> None:
    """Write the release directory: the images tarball, the manifest, the pyz files, the
    compose files and the Unraid template (from --source), and SHA256SUMS (which
    sha256sum -c --strict accepts).

    The four images must be in dockerd as <name>:VERSION (modelforge-release images).
    """
    from .bundle import BundleError, make_bundle
    from .dockerd import DaemonError, connect

    _check_release_version(release_version)
    dist = dist or (source / "dist" if source else None)
    template = template or (source / "SHA256SUMS.template" if source else None)
    if dist is None or source is None:
        _fail("not running from a ModelForge checkout: give --source and --dist", EXIT_USAGE)
    try:
        names = (
            read_template(template, release_version) if template and template.is_file() else None
        )
        client = connect()
        result = make_bundle(
            client,
            release_version,
            out.absolute(),
            dist.absolute(),
            source.absolute(),
            names,
            progress=sys.stderr,
        )
    except SumsError as exc:
        _fail(str(exc), EXIT_USAGE)
    except (BundleError, DaemonError, OSError) as exc:
        _fail(str(exc), EXIT_FAILED)
    _emit(as_json, result.as_json(), [f"{item['name']} {item['sha256']}" for item in result.files])
    click.echo(f"next: {PROG} sign --key YOUR_RELEASE_KEY {out}", err=True)


@main.command()
@click.option(
    "--key",
    "key_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The OpenSSH Ed25519 private key (ssh-keygen -t ed25519); kept outside DIR.",
)
@click.option(
    "--passphrase-fd",
    type=int,
    help="Read an encrypted key's passphrase from this file descriptor (first line) instead "
    "of asking on the terminal.",
)
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
def sign(key_path: Path, passphrase_fd: int | None, directory: Path) -> None:
    """Sign DIRECTORY/SHA256SUMS: write DIRECTORY/SHA256SUMS.sig, an SSH signature in the
    namespace modelforge-release that stock OpenSSH checks:

    \b
      ssh-keygen -Y verify -f allowed_signers -I PRINCIPAL -n modelforge-release \\
          -s SHA256SUMS.sig < SHA256SUMS

    An encrypted key's passphrase is asked for without echo. Prints the public key line
    for allowed_signers. Exit 0 signed, 2 the key or SHA256SUMS cannot be used.
    """
    _need_module("cryptography", "sign")
    from .signing import NAMESPACE, SigningError, sign_sums

    try:
        target, public = sign_sums(directory, key_path, passphrase_fd)
    except SigningError as exc:
        _fail(str(exc), EXIT_USAGE)
    click.echo(f"wrote {target}")
    click.echo(f'allowed_signers line: PRINCIPAL namespaces="{NAMESPACE}" {public}')


@main.command("verify-bundle")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--signers",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="An allowed_signers file (docs/release-verification.md): check SHA256SUMS.sig "
    "against it first, with the host's ssh-keygen.",
)
@click.option(
    "--principal",
    default=RELEASE_PRINCIPAL,
    show_default=True,
    help="With --signers: the principal whose key must have signed, as ssh-keygen -Y verify -I "
    "takes it (a line of the file for another principal, or one negating it, does not count).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
def verify_bundle_command(
    directory: Path, signers: Path | None, principal: str, as_json: bool
) -> None:
    """Check a release directory without a daemon: with --signers the signature over
    SHA256SUMS first; then SHA256SUMS (exactly the release's files, in order, each
    matching, and nothing else in the directory); then the images tarball against the
    manifest, image by image, runtime configuration included.

    Reads both layouts: docker save (manifest.json, <id>/layer.tar) and OCI (index.json,
    blobs/sha256/, gzip layers), and refuses what docker might read differently: links,
    names that repeat, absolute or '..' names, stray entries. Each problem names the file,
    the image and the field. Exit 0 all good, 1 any problem.
    """
    from .verify import verify_bundle

    report = verify_bundle(directory, progress=sys.stderr, signers=signers, principal=principal)
    if as_json:
        click.echo(json.dumps(report.as_json(), indent=2, sort_keys=True))
    else:
        if signers is not None and report.signed_by:
            click.echo(f"SHA256SUMS.sig: OK ({report.signature})")
        for name, status in report.files.items():
            click.echo(f"{name}: {status}")
        for name, ok in report.images.items():
            click.echo(f"images.{name}: {'OK' if ok else 'FAILED'}")
    if signers is None:
        click.echo(f"{PROG}: signature {report.signature}", err=True)
    for finding in report.findings:
        click.echo(f"{PROG}: {finding}", err=True)
    if not report.ok:
        click.echo(
            f"{PROG}: {directory}: {len(report.findings)} problem(s); do not use this release",
            err=True,
        )
        sys.exit(EXIT_FAILED)


def _load_manifest(path: Path) -> dict:
    try:
        return parse_manifest(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        _fail(f"cannot read {path}: {exc}", EXIT_USAGE)
    except ManifestError as exc:
        parts = [
            f"images.{image}.{problem}" if problem.field else f"images.{image}: {problem.message}"
            for image, problem in exc.problems
        ] or [str(exc)]
        for part in parts:
            click.echo(f"{PROG}: {path.name}: {part}", err=True)
        sys.exit(EXIT_FAILED)
    raise AssertionError("unreachable")


@main.command("verify-image")
@click.option(
    "--manifest",
    "manifest_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
)
@click.option(
    "--image",
    "image_name",
    type=click.Choice(IMAGE_NAMES),
    required=True,
    help="Which entry of the manifest to check (images.<IMAGE>).",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the outcome, with the local image id, as JSON."
)
def verify_image_command(manifest_path: Path, image_name: str, as_json: bool) -> None:
    """Check a loaded image against its manifest entry, via dockerd: the exact tag, the
    RootFS layers, architecture, os, every label and every runtime field (user,
    entrypoint, command, environment, ...). The image id is not compared
    (docker load may rewrite it); it is printed, so a script can pin it for
    verify-container. Exit 0 match, 1 mismatch."""
    from .dockerd import DaemonError, connect, verify_image

    manifest = _load_manifest(manifest_path)
    entry = manifest["images"].get(image_name)
    if entry is None:
        _fail(f"{manifest_path.name}: images.{image_name}: not in this manifest", EXIT_FAILED)
    try:
        check = verify_image(connect(), image_name, entry)
    except DaemonError as exc:
        _fail(str(exc), EXIT_FAILED)
    document = {
        "ok": check.ok,
        "image": image_name,
        "tag": check.tag,
        "image_id": check.image_id,
        "problems": [{"field": p.field, "message": p.message} for p in check.problems],
    }
    _emit(
        as_json,
        document,
        [f"{check.tag}: {'OK' if check.ok else 'FAILED'} (local image {check.image_id})"],
    )
    for problem in check.problems:
        click.echo(f"{PROG}: {check.tag}: images.{image_name}.{problem}", err=True)
    if not check.ok:
        sys.exit(EXIT_FAILED)


@main.command("verify-container")
@click.argument("container")
@click.option(
    "--image-id",
    required=True,
    help="sha256:<64 hex>, captured (verify-image --json) before the container was created.",
)
@click.option(
    "--user",
    help="The user the container runs as on purpose when it is not the image's (Unraid's "
    "template runs the control plane as 99:100); any other user is still a mismatch.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
def verify_container_command(
    container: str, image_id: str, user: str | None, as_json: bool
) -> None:
    """Check that CONTAINER (name or id) was created from exactly IMAGE_ID (a tag moved to
    another image between the check and the start is caught) and runs it as the image
    says: the same user, entrypoint, command, working directory, health check and stop
    signal, and no environment beyond the operator's settings (MODELFORGE_*, NVIDIA_*,
    TZ). Exit 0 match, 1 mismatch."""
    from .dockerd import DaemonError, connect, is_image_id, verify_container

    if not is_image_id(image_id):
        _fail(f"--image-id {image_id!r} is not sha256:<64 hex digits>", EXIT_USAGE)
    try:
        check = verify_container(connect(), container, image_id, user)
    except DaemonError as exc:
        _fail(str(exc), EXIT_FAILED)
    document = {
        "ok": check.ok,
        "container": container,
        "image_id": check.image_id,
        "expected_image_id": image_id,
        "created_from": check.created_from,
        "problems": check.problems,
    }
    _emit(
        as_json,
        document,
        [
            f"{container}: {'OK' if check.ok else 'FAILED'}"
            + (f" (image {check.image_id})" if check.image_id else "")
        ],
    )
    for problem in check.problems:
        click.echo(f"{PROG}: {problem}", err=True)
    if not check.ok:
        sys.exit(EXIT_FAILED)
