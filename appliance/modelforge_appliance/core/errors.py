"""One error tree: each error knows its HTTP status, stable code and next step.

The web layer renders every one of them as
``{"error": {"code", "message", "next_step"}}`` (invariant 11).
"""

from __future__ import annotations

from typing import Any


class OperatorError(Exception):
    """Something the operator must put right before a command can run (a wrong setting, a
    store from a newer program, a refused restore, the state lock held): the CLI prints the
    message as one line and exits 2. Declared here, below every layer that raises one, so the
    CLI's one handler catches them without importing the store."""


class ApiError(Exception):
    status = 400
    code = "BAD_REQUEST"
    next_step = "Correct the request and send it again."
    # Whether the error hook logs the refusal; one that a throttle counts (a wrong API key)
    # is said once per burst instead (identity/key_guesses.py).
    logged = True

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        next_step: str | None = None,
        status: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if next_step is not None:
            self.next_step = next_step
        if status is not None:
            self.status = status
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        error = {"code": self.code, "message": self.message, "next_step": self.next_step}
        return {"error": error, **self.extra}


class Invalid(ApiError):
    status = 400


class Unauthorized(ApiError):
    status = 401
    next_step = "Send a valid, unrevoked credential."


class Forbidden(ApiError):
    status = 403
    next_step = "Use the credential issued for this node."


class NotFound(ApiError):
    status = 404
    code = "NOT_FOUND"
    next_step = "Check the id or path; list the collection to see what exists."


class Conflict(ApiError):
    status = 409


class Gone(ApiError):
    status = 410
    next_step = "Mint a fresh enrollment token (`modelforge enroll --name NAME --expires 15m`)."


class TooLarge(ApiError):
    status = 413
    code = "BODY_TOO_LARGE"


class TooManyRequests(ApiError):
    """429: ``retry_after_seconds`` in ``extra`` becomes the ``Retry-After`` header."""

    status = 429


class UpgradeRequired(ApiError):
    status = 426
    code = "PROTOCOL_INCOMPATIBLE"


class StoreUnavailable(ApiError):
    status = 503
    code = "STORE_UNAVAILABLE"
    next_step = "Check that the database is reachable, then retry."
