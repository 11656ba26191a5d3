"""Admin routes for users with roles (identity/users.py): add, list, change (role, enabled,
password). Only an admin changes users; every role may read them (no secret is in them)."""

from __future__ import annotations

import bottle

from modelforge_contract import PATH_ADMIN_USER, PATH_ADMIN_USERS

from ..core.validation import Field
from ..identity import users
from ..web.auth import ADMIN
from ..web.http import ApiContext, json_response

ADD_FIELDS = {
    "name": Field(str, low=1, high=64),
    "role": Field(str, low=1, high=16),
    "password": Field(str, required=False, nullable=True, low=1, high=200),
}
CHANGE_FIELDS = {
    "role": Field(str, required=False, low=1, high=16),
    "disabled": Field(bool, required=False),
    "password": Field(str, required=False, low=1, high=200),
}


def add_routes(app: bottle.Bottle, context: ApiContext) -> None:
    store = context.store

    @app.post(PATH_ADMIN_USERS, auth=ADMIN, action="users.write")
    def add(actor: str):
        fields = context.body(ADD_FIELDS)
        made = users.add_user(store, fields["name"], fields["role"], fields.get("password"), actor)
        return json_response(made, 201)

    @app.get(PATH_ADMIN_USERS, auth=ADMIN, action="users.read")
    def listed():
        return json_response({"users": users.list_users(store)})

    @app.route(PATH_ADMIN_USER, method="PATCH", auth=ADMIN, action="users.write")
    def change(name: str, actor: str):
        fields = context.body(CHANGE_FIELDS)
        users.get_user(store, name)  # 404 first, before any field is looked at
        if "role" in fields:
            users.set_role(store, name, fields["role"], actor)
        if "disabled" in fields:
            users.set_disabled(store, name, fields["disabled"], actor)
        if "password" in fields:
            users.set_password(store, name, fields["password"], actor)
        return json_response(users.get_user(store, name))
