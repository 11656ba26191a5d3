"""The file names of a release directory (DESIGN §7), kept apart so the verifiers can
import them without the build machinery."""

from __future__ import annotations

CONTROL_PLANE_PYZ = "modelforge.pyz"
AGENT_PYZ = "modelforge-node-agent.pyz"
SUMS_NAME = "SHA256SUMS"
# SHA256SUMS.template, as the verifier needs it when no checkout is at hand (a test keeps
# the two the same).
TEMPLATE_NAMES = (
    "modelforge-{version}-images.tar",
    "modelforge-{version}-manifest.json",
    CONTROL_PLANE_PYZ,
    AGENT_PYZ,
)


def release_names(version: str) -> list[str]:
    return [name.replace("{version}", version) for name in TEMPLATE_NAMES]


def tarball_name(version: str) -> str:
    return f"modelforge-{version}-images.tar"


def manifest_name(version: str) -> str:
    return f"modelforge-{version}-manifest.json"
