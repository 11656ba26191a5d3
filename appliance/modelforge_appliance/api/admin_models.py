"""Admin model routes: import or pull, list, show, delete, replicate, and the hub token
(docs/architecture.md §10)."""

from __future__ import annotations

import bottle

from modelforge_contract.hub import (
    PATH_ADMIN_HUB_TOKEN,
    PATH_ADMIN_MODEL_PULL,
    PATH_ADMIN_MODEL_PULLS,
)
from modelforge_contract.models import (
    PATH_ADMIN_MODEL,
    PATH_ADMIN_MODEL_REPLICA,
    PATH_ADMIN_MODEL_REPLICAS,
    PATH_ADMIN_MODELS,
)

from ..core.sealing import WorkKeys
from ..core.validation import HUB_TOKEN_FIELDS, IMPORT_MODEL_FIELDS, REPLICATE_FIELDS
from ..models import catalog, hub_token, pulls, replicas
from ..web.auth import ADMIN
from ..web.http import ApiContext, json_response


def _revision() -> str | None:
    return bottle.request.query.get("revision") or None


def add_routes(app: bottle.Bottle, context: ApiContext) -> None:
    settings, store = context.settings, context.store

    # Pulls from a hub run on threads of this process; their views are read below.
    runner = app.model_pulls = pulls.PullRunner(settings, store)

    @app.post(PATH_ADMIN_MODELS, auth=ADMIN, action="models.write")
    def import_model(actor: str):
        fields = context.body(IMPORT_MODEL_FIELDS)
        source = pulls.source_of(fields["source"])
        if not isinstance(source, str):  # a hub: 202 once it may start; the pull runs on
            pull = runner.start(fields["name"], source, fields.get("revision"), actor)
            answer = json_response({"pull": pull}, 202)
            answer.set_header(
                "Location", PATH_ADMIN_MODEL_PULL.replace("<pull_id>", pull["pull_id"])
            )
            return answer
        imported = catalog.import_model(
            store,
            settings.state_dir,
            fields["name"],
            source,
            actor,
            revision=fields.get("revision"),
        )
        return json_response(catalog.model_view(imported.model), 201 if imported.created else 200)

    @app.get(PATH_ADMIN_MODEL_PULLS, auth=ADMIN, action="models.read")
    def list_pulls():
        return json_response({"pulls": runner.views()})

    @app.get(PATH_ADMIN_MODEL_PULL, auth=ADMIN, action="models.read")
    def show_pull(pull_id: str):
        return json_response({"pull": runner.view(pull_id)})

    @app.get(PATH_ADMIN_HUB_TOKEN, auth=ADMIN, action="hub_token.read")
    def show_hub_token():
        return json_response(hub_token.token_view(store))

    @app.put(PATH_ADMIN_HUB_TOKEN, auth=ADMIN, action="hub_token.write")
    def set_hub_token(actor: str):
        token = context.body(HUB_TOKEN_FIELDS)["token"]
        keys = WorkKeys.of(settings.state_dir)
        return json_response(hub_token.set_token(store, keys, token, actor))

    @app.delete(PATH_ADMIN_HUB_TOKEN, auth=ADMIN, action="hub_token.write")
    def clear_hub_token(actor: str):
        cleared = hub_token.clear_token(store, actor)
        return json_response({**hub_token.token_view(store), "cleared": cleared})

    @app.get(PATH_ADMIN_MODELS, auth=ADMIN, action="models.read")
    def list_models():
        return json_response({"models": catalog.list_models(store)})

    @app.get(PATH_ADMIN_MODEL, auth=ADMIN, action="models.read")
    def show(name: str):
        model = catalog.get_revision(store, name, _revision())
        view = catalog.model_view(model)
        view["revisions"] = [catalog.revision_summary(m) for m in catalog.revisions_of(store, name)]
        view["replicas"] = replicas.list_replicas(store, [model])
        return json_response(view)

    @app.delete(PATH_ADMIN_MODEL, auth=ADMIN, action="models.write")
    def delete(name: str, actor: str):
        deleted = catalog.delete_model(store, settings.state_dir, name, actor, _revision())
        return json_response({"name": name, "deleted": deleted})

    @app.post(PATH_ADMIN_MODEL_REPLICAS, auth=ADMIN, action="models.write")
    def replicate(name: str, actor: str):
        fields = context.body(REPLICATE_FIELDS)
        made = replicas.replicate(
            store, settings, name, fields["node_ids"], actor, fields.get("revision")
        )
        return json_response({"replicas": made}, 202)

    @app.get(PATH_ADMIN_MODEL_REPLICAS, auth=ADMIN, action="models.read")
    def list_replicas(name: str):
        revision = _revision()
        models = (
            [catalog.get_revision(store, name, revision)]
            if revision
            else catalog.revisions_of(store, name)
        )
        return json_response({"replicas": replicas.list_replicas(store, models)})

    @app.delete(PATH_ADMIN_MODEL_REPLICA, auth=ADMIN, action="models.write")
    def remove_replica(name: str, node_id: str, actor: str):
        removed = replicas.remove_replica(store, name, node_id, actor, _revision())
        return json_response({"replicas": removed}, 202)
