"""Admin model routes: import, list, show, delete, replicate (docs/architecture.md §10)."""

from __future__ import annotations

import bottle

from modelforge_contract.models import (
    PATH_ADMIN_MODEL,
    PATH_ADMIN_MODEL_REPLICA,
    PATH_ADMIN_MODEL_REPLICAS,
    PATH_ADMIN_MODELS,
)

from ..core.validation import IMPORT_MODEL_FIELDS, REPLICATE_FIELDS
from ..models import catalog, replicas
from ..web.auth import ADMIN
from ..web.http import ApiContext, json_response


def _revision() -> str | None:
    return bottle.request.query.get("revision") or None


def add_routes(app: bottle.Bottle, context: ApiContext) -> None:
    settings, store = context.settings, context.store

    @app.post(PATH_ADMIN_MODELS, auth=ADMIN)
    def import_model(actor: str):
        fields = context.body(IMPORT_MODEL_FIELDS)
        imported = catalog.import_model(
            store,
            settings.state_dir,
            fields["name"],
            fields["source"]["path"],
            actor,
            revision=fields.get("revision"),
        )
        return json_response(catalog.model_view(imported.model), 201 if imported.created else 200)

    @app.get(PATH_ADMIN_MODELS, auth=ADMIN)
    def list_models():
        return json_response({"models": catalog.list_models(store)})

    @app.get(PATH_ADMIN_MODEL, auth=ADMIN)
    def show(name: str):
        model = catalog.get_revision(store, name, _revision())
        view = catalog.model_view(model)
        view["revisions"] = [catalog.revision_summary(m) for m in catalog.revisions_of(store, name)]
        view["replicas"] = replicas.list_replicas(store, [model])
        return json_response(view)

    @app.delete(PATH_ADMIN_MODEL, auth=ADMIN)
    def delete(name: str, actor: str):
        deleted = catalog.delete_model(store, settings.state_dir, name, actor, _revision())
        return json_response({"name": name, "deleted": deleted})

    @app.post(PATH_ADMIN_MODEL_REPLICAS, auth=ADMIN)
    def replicate(name: str, actor: str):
        fields = context.body(REPLICATE_FIELDS)
        made = replicas.replicate(
            store, settings, name, fields["node_ids"], actor, fields.get("revision")
        )
        return json_response({"replicas": made}, 202)

    @app.get(PATH_ADMIN_MODEL_REPLICAS, auth=ADMIN)
    def list_replicas(name: str):
        revision = _revision()
        models = (
            [catalog.get_revision(store, name, revision)]
            if revision
            else catalog.revisions_of(store, name)
        )
        return json_response({"replicas": replicas.list_replicas(store, models)})

    @app.delete(PATH_ADMIN_MODEL_REPLICA, auth=ADMIN)
    def remove_replica(name: str, node_id: str, actor: str):
        removed = replicas.remove_replica(store, name, node_id, actor, _revision())
        return json_response({"replicas": removed}, 202)
