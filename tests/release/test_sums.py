"""``modelforge-release sums`` writes what ``sha256sum`` writes, byte for byte."""

from __future__ import annotations

from pathlib import Path

from tests.harness.release_cli import RELEASE_FILES, make_files, release, sha256sum

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "SHA256SUMS.template"
TEMPLATE_ORDER = [
    "modelforge-0.1.0-images.tar",
    "modelforge-0.1.0-manifest.json",
    "modelforge-x86_64.pyz",
    "modelforge-aarch64.pyz",
    "modelforge-node-agent.pyz",
    "modelforge-runtime-worker.pyz",
    "docker-compose.yml",
    "docker-compose.node-agent.yml",
    "docker-compose.node-agent.private-ca.yml",
    "docker-compose.runtime-worker.yml",
    "docker-compose.gpu.yml",
    "docker-compose.node-recovery.yml",
    "modelforge-control-plane.xml",
    "modelforge.service",
    "modelforge-node-agent.service",
    "modelforge-runtime-worker.service",
]


def test_output_is_byte_for_byte_what_sha256sum_writes(tmp_path):
    names = list(RELEASE_FILES)
    make_files(tmp_path, RELEASE_FILES)
    result = release("sums", *names, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    expected = sha256sum(*names, cwd=tmp_path)
    assert expected.returncode == 0
    assert (tmp_path / "SHA256SUMS").read_bytes() == expected.stdout
    assert (
        b"e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855  modelforge-node-agent.pyz\n"
        in expected.stdout
    )


def test_names_needing_escapes_match_sha256sum(tmp_path):
    """coreutils prefixes the line with a backslash and escapes \\, \\n and \\r in the name."""
    contents = {"back\\slash": b"a", "new\nline": b"b", "carriage\rreturn": b"c", "sp ace": b"d"}
    make_files(tmp_path, contents)
    assert release("sums", *contents, cwd=tmp_path).returncode == 0
    expected = sha256sum(*contents, cwd=tmp_path).stdout
    assert expected.count(b"\n\\") == 2  # sanity: sha256sum did escape
    assert (tmp_path / "SHA256SUMS").read_bytes() == expected


def test_names_are_relative_to_the_output_directory(tmp_path):
    dist = tmp_path / "dist"
    make_files(
        dist, {"modelforge-x86_64.pyz": b"pyz", "images/modelforge-0.1.0-images.tar": b"tar"}
    )
    result = release(
        "sums",
        "--output",
        dist / "SHA256SUMS",
        dist / "modelforge-x86_64.pyz",
        dist / "images" / "modelforge-0.1.0-images.tar",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    expected = sha256sum("modelforge-x86_64.pyz", "images/modelforge-0.1.0-images.tar", cwd=dist)
    assert (dist / "SHA256SUMS").read_bytes() == expected.stdout


def test_a_file_outside_the_output_directory_is_refused(tmp_path):
    make_files(tmp_path, {"outside": b"x", "dist/inside": b"y"})
    result = release(
        "sums",
        "--output",
        tmp_path / "dist" / "SHA256SUMS",
        tmp_path / "outside",
        tmp_path / "dist" / "inside",
    )
    assert result.returncode == 2
    assert b"is not inside" in result.stderr
    assert not (tmp_path / "dist" / "SHA256SUMS").exists()


def test_template_order_wins_over_argument_order(tmp_path):
    make_files(tmp_path, RELEASE_FILES)
    reversed_args = list(reversed(TEMPLATE_ORDER))
    result = release(
        "sums", "--template", TEMPLATE, "--version", "0.1.0", *reversed_args, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    lines = (tmp_path / "SHA256SUMS").read_bytes().splitlines()
    assert [line.split(b"  ", 1)[1].decode() for line in lines] == TEMPLATE_ORDER
    assert (tmp_path / "SHA256SUMS").read_bytes() == sha256sum(*TEMPLATE_ORDER, cwd=tmp_path).stdout


def test_template_comments_and_version_placeholder(tmp_path):
    template = tmp_path / "SHA256SUMS.template"
    template.write_text(
        "# comment {version} is not a file\n\nb-{version}.tar\n  # indented\na.pyz\n"
    )
    make_files(tmp_path, {"a.pyz": b"a", "b-2.0.0rc1.tar": b"b"})
    result = release(
        "sums",
        "--template",
        template,
        "--version",
        "2.0.0rc1",
        "a.pyz",
        "b-2.0.0rc1.tar",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "SHA256SUMS").read_bytes() == sha256sum(
        "b-2.0.0rc1.tar", "a.pyz", cwd=tmp_path
    ).stdout


def test_template_needs_version(tmp_path):
    make_files(tmp_path, RELEASE_FILES)
    result = release("sums", "--template", TEMPLATE, *TEMPLATE_ORDER, cwd=tmp_path)
    assert result.returncode == 2
    assert b"needs --version" in result.stderr
    assert not (tmp_path / "SHA256SUMS").exists()


def test_files_must_be_exactly_the_templates(tmp_path):
    make_files(tmp_path, RELEASE_FILES | {"stray.txt": b"x"})
    extra = release(
        "sums",
        "--template",
        TEMPLATE,
        "--version",
        "0.1.0",
        *TEMPLATE_ORDER,
        "stray.txt",
        cwd=tmp_path,
    )
    assert extra.returncode == 2
    assert b"not in the template: stray.txt" in extra.stderr
    short = release(
        "sums", "--template", TEMPLATE, "--version", "0.1.0", *TEMPLATE_ORDER[:-1], cwd=tmp_path
    )
    assert short.returncode == 2
    assert b"not given: modelforge-runtime-worker.service" in short.stderr
    assert not (tmp_path / "SHA256SUMS").exists()


def test_missing_input_leaves_previous_sums_untouched_and_no_temp_file(tmp_path):
    make_files(tmp_path, RELEASE_FILES)
    previous = b"previous release sums\n"
    (tmp_path / "SHA256SUMS").write_bytes(previous)
    before = sorted(p.name for p in tmp_path.iterdir())
    # The missing file comes last, so the others have already been hashed when it fails.
    result = release("sums", *TEMPLATE_ORDER[:3], "modelforge-node-agent-missing.pyz", cwd=tmp_path)
    assert result.returncode == 1
    assert b"cannot read modelforge-node-agent-missing.pyz" in result.stderr
    assert (tmp_path / "SHA256SUMS").read_bytes() == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_output_replaces_previous_file_and_is_world_readable(tmp_path):
    make_files(tmp_path, RELEASE_FILES)
    (tmp_path / "SHA256SUMS").write_bytes(b"stale\n" * 1000)
    assert release("sums", *TEMPLATE_ORDER, cwd=tmp_path).returncode == 0
    assert (tmp_path / "SHA256SUMS").read_bytes() == sha256sum(*TEMPLATE_ORDER, cwd=tmp_path).stdout
    assert (tmp_path / "SHA256SUMS").stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*TEMPLATE_ORDER, "SHA256SUMS"])


def test_images_refuses_a_version_that_is_not_the_sources(tmp_path):
    """Following release.md with --version 1.3.0 built images labelled 1.3.0 holding 0.1.0's
    code, with no warning."""
    from modelforge_contract import __version__
    from tests.harness.release_cli import release

    other = release("images", "--version", "9.9.9", "--dist", tmp_path)
    assert other.returncode == 2
    assert (
        f"--version 9.9.9 is not the version of the source ({__version__}" in other.stderr.decode()
    )
    assert not list(tmp_path.iterdir())  # refused before anything was built
