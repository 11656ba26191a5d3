"""Which links of a model split across nodes the hub splices (deployments/split.py).

A LINK comes from an agent: its main server dials a helper. Only a split's main server on
that very node may open one, and only to a helper of the same deployment, both still asked
to run; everything else is refused (RESET ``LINK_REFUSED``), so a node that is not a member
reaches no helper's ``ggml-rpc-server``.
"""

from __future__ import annotations

from modelforge_contract.deployments import ROLE_HELPER, ROLE_MAIN, SERVER_STOPPED

from ..store.database import Store
from ..store.tables import Deployment, DeploymentServer
from .hub import LinkAuthority, LinkRefused


def authorizer(store: Store) -> LinkAuthority:
    """The hub's ``authorize_link``: node ``node_id``'s server ``server_id`` may link to
    ``peer_server_id`` only as the main server of a split whose helper that is, both still
    asked to run. Answers the helper's node id; LinkRefused otherwise."""

    def authorize(node_id: str, server_id: str, peer_server_id: str) -> str:
        with store.connection():
            rows = {
                s.server_id: s
                for s in DeploymentServer.select(DeploymentServer, Deployment)
                .join(Deployment)
                .where(DeploymentServer.server_id.in_([server_id, peer_server_id]))
            }
        main, helper = rows.get(server_id), rows.get(peer_server_id)
        if main is None or main.node_id != node_id or main.role != ROLE_MAIN:
            raise LinkRefused(f"server {server_id} is not a split's main server on this node")
        if (
            helper is None
            or helper.deployment_id != main.deployment_id
            or helper.role != ROLE_HELPER
        ):
            raise LinkRefused(f"server {peer_server_id} is not a helper of this deployment")
        if main.deployment.stopping or SERVER_STOPPED in (main.state, helper.state):
            raise LinkRefused("the deployment is stopping")
        return str(helper.node_id)

    return authorize
