"""Admin routes for client API keys: create (the secret shown once), list, revoke."""

from __future__ import annotations

import bottle

from modelforge_contract import PATH_ADMIN_API_KEY, PATH_ADMIN_API_KEYS

from ..core.validation import API_KEY_FIELDS
from ..identity import api_keys
from ..web.auth import ADMIN
from ..web.http import ApiContext, json_response


def add_routes(app: bottle.Bottle, context: ApiContext) -> None:
    store = context.store

    @app.post(PATH_ADMIN_API_KEYS, auth=ADMIN)
    def create(actor: str):
        fields = context.body(API_KEY_FIELDS)
        view, secret = api_keys.create_api_key(store, fields["name"], actor)
        return json_response({**view, "secret": secret}, 201)

    @app.get(PATH_ADMIN_API_KEYS, auth=ADMIN)
    def list_keys():
        return json_response({"api_keys": api_keys.list_api_keys(store)})

    @app.delete(PATH_ADMIN_API_KEY, auth=ADMIN)
    def revoke(key_id: str, actor: str):
        return json_response(api_keys.revoke_api_key(store, key_id, actor))
