"""Admin work routes: submit, list, show, cancel (docs/architecture.md §5)."""

from __future__ import annotations

import bottle

from modelforge_contract import PATH_ADMIN_WORK, PATH_ADMIN_WORK_CANCEL, PATH_ADMIN_WORK_ITEM

from ..core.sealing import WorkKeys
from ..core.validation import SUBMIT_WORK_FIELDS
from ..web.auth import ADMIN
from ..web.http import ApiContext, json_response, query_int
from ..work import items
from .agent_work import expire_leases


def add_routes(app: bottle.Bottle, context: ApiContext) -> None:
    settings, store = context.settings, context.store

    @app.post(PATH_ADMIN_WORK, auth=ADMIN, action="work.write")
    def submit(actor: str):
        submission = items.submission_from(context.body(SUBMIT_WORK_FIELDS), settings)
        submitted = items.submit_work(store, submission, actor, WorkKeys.of(settings.state_dir))
        return json_response(items.work_view(submitted.item), 201 if submitted.created else 200)

    @app.get(PATH_ADMIN_WORK, auth=ADMIN, action="work.read")
    def list_work():
        expire_leases(context)
        query = bottle.request.query
        return json_response(
            items.list_work(
                store,
                state=query.get("state") or None,
                limit=query_int("limit", 50, 1, 500),
                before=query.get("before") or None,
            )
        )

    @app.get(PATH_ADMIN_WORK_ITEM, auth=ADMIN, action="work.read")
    def show(work_id: str):
        expire_leases(context)
        return json_response(items.work_view(items.get_work(store, work_id)))

    @app.post(PATH_ADMIN_WORK_CANCEL, auth=ADMIN, action="work.write")
    def cancel(work_id: str, actor: str):
        expire_leases(context)
        return json_response(items.work_view(items.cancel_work(store, work_id, actor)))
