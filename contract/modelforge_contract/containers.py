"""The ``container`` capability's fence, as both sides check it: the control plane at submit
(within its admin-set maxima) and the worker before docker is asked (docs/work.md).

An item names its limits or gets these defaults; anything dockerd would refuse is refused
here first, with the field named, so no raw docker error reaches an item's outcome.
Standard library only.
"""

from __future__ import annotations

import re

MIB = 2**20

# dockerd refuses a memory limit below 6 MiB ("Minimum memory limit allowed is 6MB").
MEMORY_MIN_BYTES = 6 * MIB
MEMORY_DEFAULT_BYTES = 512 * MIB
# Swap beyond the memory limit; docker's memswap limit is memory + swap.
SWAP_DEFAULT_BYTES = 0
PIDS_MIN = 8
PIDS_DEFAULT = 512
CPUS_MIN = 0.01  # docker's nano_cpus granularity for a useful quota
CPUS_DEFAULT = 2.0
# The root filesystem is read-only; /tmp is a tmpfs of this size (it counts as memory).
TMP_MIN_BYTES = 1 * MIB
TMP_DEFAULT_BYTES = 64 * MIB
# The host's json-file log of the container: two files of half this size each.
LOG_MIN_BYTES = 1 * MIB
LOG_DEFAULT_BYTES = 8 * MIB
LOG_FILES = 2
# Who the container runs as unless the item asks for root (and the admin allows it).
NON_ROOT_USER = "65534:65534"
TMP_PATH = "/tmp"  # noqa: S108 - inside the container: its own tmpfs, not the host's /tmp

# The Linux capabilities docker knows by name (without CAP_). Every container drops all of
# them and gets back only the ones its item asks for, from the admin's allowed list.
LINUX_CAPABILITIES = (
    "AUDIT_CONTROL",
    "AUDIT_READ",
    "AUDIT_WRITE",
    "BLOCK_SUSPEND",
    "BPF",
    "CHECKPOINT_RESTORE",
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "IPC_LOCK",
    "IPC_OWNER",
    "KILL",
    "LEASE",
    "LINUX_IMMUTABLE",
    "MAC_ADMIN",
    "MAC_OVERRIDE",
    "MKNOD",
    "NET_ADMIN",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_RAW",
    "PERFMON",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYSLOG",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_CHROOT",
    "SYS_MODULE",
    "SYS_NICE",
    "SYS_PACCT",
    "SYS_PTRACE",
    "SYS_RAWIO",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "WAKE_ALARM",
)

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")

# docker's reference grammar (distribution/reference): [domain/]path[:tag][@digest], the path
# in lower case, at most 255 characters of name.
_ALNUM = r"[a-z0-9]+"
_PATH_COMPONENT = rf"{_ALNUM}(?:(?:[._]|__|-+){_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*(?::[0-9]+)?"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_REFERENCE = re.compile(rf"(?P<name>{_NAME})(?::{_TAG})?(?:@{_DIGEST})?")
NAME_MAX_CHARS = 255


def image_reference_problem(reference: str) -> str | None:
    """Why docker would refuse ``reference`` as an image name, or None when it would not."""
    match = _REFERENCE.fullmatch(reference)
    if match is None:
        return (
            "must be an image reference such as name:1.0 or registry.example:5000/team/name:1.0 "
            "(lower-case name, optional tag and digest)"
        )
    if len(match.group("name")) > NAME_MAX_CHARS:
        return f"the name before the tag must be at most {NAME_MAX_CHARS} characters"
    return None


def env_value_problem(value: str) -> str | None:
    """Why docker (or the kernel's execve) would refuse ``value`` in an environment."""
    if "\x00" in value:
        return "must not contain a NUL character"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "must be valid Unicode text"
    return None
