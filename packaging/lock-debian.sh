#!/usr/bin/env bash
# Re-lock packaging/images/debian-packages.lock from debian-packages.in: every package of
# the images' root filesystems with its dependencies, pinned to the version this machine's
# apt offers now, with its SHA-256. Run on a Debian bookworm amd64 host after
# `apt-get update`, when the .in file changes or to take Debian's security updates; then
# rebuild the images (modelforge-release images) and commit both files.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH=release:contract exec python3 -m modelforge_release.debian \
    packaging/images/debian-packages.in packaging/images/debian-packages.lock "$@"
