"""The file names of a release directory (docs/architecture.md §7), kept apart so the verifiers can
import them without the build machinery."""

from __future__ import annotations

# The control plane's archive as installed: /opt/modelforge/modelforge.pyz, in the image as
# under systemd. A release carries one per machine (packaging/build_pyz.py), named for
# `uname -m`; an image carries the one for its architecture under this name.
CONTROL_PLANE_PYZ = "modelforge.pyz"
CONTROL_PLANE_ARCHIVES = {"amd64": "modelforge-x86_64.pyz", "arm64": "modelforge-aarch64.pyz"}
AGENT_PYZ = "modelforge-node-agent.pyz"
# The runtime worker's archive, beside the agent's on a systemd host (docs/install-systemd.md).
WORKER_PYZ = "modelforge-runtime-worker.pyz"
SUMS_NAME = "SHA256SUMS"
SIGNATURE_NAME = "SHA256SUMS.sig"
# The control-plane image pins the archive it carries by this label (its SHA-256 hex): the
# release's archive for that architecture must be exactly it.
LABEL_PYZ = "io.modelforge.control-plane-pyz-sha256"
# What an operator runs the release with, shipped beside the images: {name in the release
# directory: its path in the checkout}.
DEPLOYMENT_FILES = {
    "docker-compose.yml": "docker-compose.yml",
    "docker-compose.node-agent.yml": "docker-compose.node-agent.yml",
    "docker-compose.node-agent.private-ca.yml": "docker-compose.node-agent.private-ca.yml",
    "docker-compose.runtime-worker.yml": "docker-compose.runtime-worker.yml",
    "docker-compose.gpu.yml": "docker-compose.gpu.yml",
    "docker-compose.node-recovery.yml": "docker-compose.node-recovery.yml",
    "modelforge-control-plane.xml": "packaging/unraid/modelforge-control-plane.xml",
    "modelforge.service": "systemd/modelforge.service",
    "modelforge-node-agent.service": "systemd/modelforge-node-agent.service",
    "modelforge-runtime-worker.service": "systemd/modelforge-runtime-worker.service",
}
# SHA256SUMS.template, as the verifier needs it when no checkout is at hand (a test keeps
# the two the same).
TEMPLATE_NAMES = (
    "modelforge-{version}-images.tar",
    "modelforge-{version}-manifest.json",
    *CONTROL_PLANE_ARCHIVES.values(),
    AGENT_PYZ,
    WORKER_PYZ,
    *DEPLOYMENT_FILES,
)


def control_plane_archive(architecture: str) -> str:
    """The release file of the control-plane archive for a Debian architecture (amd64)."""
    return CONTROL_PLANE_ARCHIVES[architecture]


def release_names(version: str) -> list[str]:
    return [name.replace("{version}", version) for name in TEMPLATE_NAMES]


def tarball_name(version: str) -> str:
    return f"modelforge-{version}-images.tar"


def manifest_name(version: str) -> str:
    return f"modelforge-{version}-manifest.json"


# Who signs ModelForge's releases: the principal an allowed_signers line must name, exactly as
# the documented ``ssh-keygen -Y verify -I releases@modelforge`` requires.
RELEASE_PRINCIPAL = "releases@modelforge"
