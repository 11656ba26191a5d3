"""Admin deployment routes: deploy, list, show, restart, change settings, undeploy, and
members joining and leaving (docs/architecture.md §11)."""

from __future__ import annotations

import bottle

from modelforge_contract.deployments import (
    PATH_ADMIN_DEPLOYMENT,
    PATH_ADMIN_DEPLOYMENT_RESTART,
    PATH_ADMIN_DEPLOYMENT_SERVER,
    PATH_ADMIN_DEPLOYMENT_SERVERS,
    PATH_ADMIN_DEPLOYMENTS,
    PATH_ADMIN_NODE_SERVING,
)

from ..core.clock import isoformat
from ..core.validation import DEPLOY_FIELDS, DEPLOYMENT_CHANGE_FIELDS, DEPLOYMENT_MEMBERS_FIELDS
from ..deployments import leases, members, servers
from ..fleet import nodes
from ..models import replicas
from ..web.auth import ADMIN
from ..web.http import ApiContext, json_response


def add_routes(app: bottle.Bottle, context: ApiContext) -> None:
    settings, store = context.settings, context.store

    def settle() -> None:
        leases.expire_servers(store, settings)

    @app.post(PATH_ADMIN_DEPLOYMENTS, auth=ADMIN, action="deployments.write")
    def deploy(actor: str):
        fields = context.body(DEPLOY_FIELDS)
        settle()
        made = servers.deploy(store, settings, fields, actor, context.heartbeats.pending)
        return json_response(made, 201)

    @app.get(PATH_ADMIN_DEPLOYMENTS, auth=ADMIN, action="deployments.read")
    def list_deployments():
        settle()
        listed = servers.list_deployments(store)
        # The control plane's time, so a page can age "since" stamps without the browser's.
        return json_response({"deployments": listed, "server_time": isoformat(store.clock.now())})

    @app.get(PATH_ADMIN_DEPLOYMENT, auth=ADMIN, action="deployments.read")
    def show(name: str):
        settle()
        return json_response(servers.get_deployment(store, name))

    @app.delete(PATH_ADMIN_DEPLOYMENT, auth=ADMIN, action="deployments.write")
    def undeploy(name: str, actor: str):
        settle()
        return json_response(servers.undeploy(store, name, actor))

    @app.route(PATH_ADMIN_DEPLOYMENT, method="PATCH", auth=ADMIN, action="deployments.write")
    def change_settings(name: str, actor: str):
        fields = context.body(DEPLOYMENT_CHANGE_FIELDS)
        settle()
        return json_response(servers.change_settings(store, name, fields["settings"], actor))

    @app.post(PATH_ADMIN_DEPLOYMENT_RESTART, auth=ADMIN, action="deployments.write")
    def restart(name: str, actor: str):
        settle()
        return json_response(servers.restart(store, name, actor))

    @app.get(PATH_ADMIN_NODE_SERVING, auth=ADMIN, action="deployments.read")
    def node_serving(node_id: str):
        nodes.get_node(store, node_id)  # 404 for an unknown node
        settle()
        return json_response(
            {
                "servers": servers.servers_on_node(store, node_id),
                "replicas": replicas.replicas_on_node(store, node_id),
            }
        )

    @app.post(PATH_ADMIN_DEPLOYMENT_SERVERS, auth=ADMIN, action="deployments.write")
    def add_members(name: str, actor: str):
        fields = context.body(DEPLOYMENT_MEMBERS_FIELDS)
        settle()
        view = members.add_members(store, settings, name, fields, actor, context.heartbeats.pending)
        return json_response(view)

    @app.delete(PATH_ADMIN_DEPLOYMENT_SERVER, auth=ADMIN, action="deployments.write")
    def remove_member(name: str, node: str, actor: str):
        settle()
        return json_response(members.remove_member(store, name, node, actor))
