"""The first code a ModelForge archive runs: is this interpreter one it can run on?

packaging/build_pyz.py copies this file into every archive as ``modelforge_launcher.py``,
fills in ``ARCHIVE`` and makes ``modelforge_launcher:main`` the archive's entry point.
Before anything compiled is imported it checks the running CPython against what the
archive carries, so a wrong archive or interpreter ends in one line that says what to
run instead, not in an ImportError from deep inside a dependency.

Standard library only, and written for old interpreters too (nothing newer than
f-strings, no annotations): the point is to be the one part that still runs on a Python
the archive does not support, such as Debian 11's 3.9 or Ubuntu 20.04's 3.8.
"""

import importlib
import importlib.machinery
import platform
import sys

# Filled in by packaging/build_pyz.py:
#   name       the archive's file name
#   entry      "module:function" to run when the checks pass
#   pythons    ["3.10", ...]: the CPython versions whose compiled modules it carries;
#              None for an archive without compiled modules
#   min_python the oldest CPython it runs on (archives without compiled modules)
#   machine    "x86_64" / "aarch64" for an archive with compiled modules, else None
#   glibc      the oldest glibc its compiled modules load on ("2.17"), else None
#   siblings   {"x86_64": "modelforge-x86_64.pyz", ...}: the archive for each machine
ARCHIVE = {}

EXIT_WRONG_INTERPRETER = 2
SUPPORTED_SYSTEMS = "docs/install-systemd.md lists the supported systems"


def version_tuple(text):
    return tuple(int(part) for part in text.split("."))


def running_triplet(suffixes):
    """The platform this CPython loads extension modules for, e.g. 'x86_64-linux-gnu'."""
    for suffix in suffixes:
        if suffix.startswith(".cpython-") and suffix.endswith(".so"):
            parts = suffix[len(".cpython-") : -len(".so")].split("-", 1)
            if len(parts) == 2:
                return parts[1]
    return None


def problem(archive, version, suffixes, libc):
    """Why this archive cannot run here (one line), or None when it can.

    version: sys.version_info; suffixes: importlib.machinery.EXTENSION_SUFFIXES;
    libc: platform.libc_ver().
    """
    name = archive["name"]
    running = f"{version[0]}.{version[1]}"
    full = f"{version[0]}.{version[1]}.{version[2]}"
    pythons = archive.get("pythons")
    if pythons:
        if running not in pythons:
            return (
                f"{name} runs on CPython {pythons[0]} to {pythons[-1]}; this is Python {full} "
                f"({sys.executable}). Run it with a supported python3 ({SUPPORTED_SYSTEMS})"
            )
    elif tuple(version[:2]) < version_tuple(archive["min_python"]):
        return (
            f"{name} needs Python {archive['min_python']} or newer; this is Python {full} "
            f"({sys.executable}). {SUPPORTED_SYSTEMS}"
        )
    machine = archive.get("machine")
    if not machine:
        return None
    triplet = running_triplet(suffixes)
    if triplet != f"{machine}-linux-gnu":
        siblings = archive.get("siblings") or {}
        sibling = siblings.get((triplet or "").split("-")[0]) if triplet else None
        if triplet and triplet.endswith("-linux-gnu") and sibling:
            instead = f"use {sibling} instead"
        else:
            instead = (
                f"ModelForge archives exist for {' and '.join(sorted(siblings))} Linux with glibc"
            )
        return (
            f"{name} is built for {machine} Linux (glibc); this Python is for "
            f"{triplet or 'another platform'}: {instead}"
        )
    minimum = archive.get("glibc")
    kind, found = libc
    if minimum and kind == "glibc" and found and version_tuple(found) < version_tuple(minimum):
        return (
            f"{name} needs glibc {minimum} or newer; this system has glibc {found}. "
            f"{SUPPORTED_SYSTEMS}"
        )
    return None


def main():
    reason = problem(
        ARCHIVE,
        sys.version_info,
        importlib.machinery.EXTENSION_SUFFIXES,
        platform.libc_ver(),
    )
    if reason is not None:
        sys.stderr.write(reason + "\n")
        sys.exit(EXIT_WRONG_INTERPRETER)
    module, _, function = ARCHIVE["entry"].partition(":")
    return getattr(importlib.import_module(module), function)()
