"""The logins of a shared `pdmctl server`: added and removed by its admin through MLflow's auth client.

A login the admin adds gets MLflow's default permission, READ (`default_permission` in the server's
basic_auth.ini): it reads every sweep, and MANAGEs the experiments (sweeps) it creates itself. Each person
exports their own MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD where they submit from.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from pdmctl.ledger.records import LedgerError
from pdmctl.ledger.server import CERT_ENV, PASSWORD_ENV, USER_ENV, ServerSettings, healthy


@contextlib.contextmanager
def _admin(settings: ServerSettings, admin: tuple[str, str]) -> Iterator[object]:
    """MLflow's auth client for the server, logged in as its admin (the login in this process's environment,
    as MLflow's client reads it), trusting the server's certificate where it serves HTTPS."""
    from mlflow.server.auth.client import AuthServiceClient

    if not healthy(settings.url, cafile=settings.cert):
        raise LedgerError(f"pdmctl server: nothing answers at {settings.url}: start the server first "
                          "(pdmctl server start), or name its --host/--port")  # fmt: skip
    saved = {name: os.environ.get(name) for name in (USER_ENV, PASSWORD_ENV, CERT_ENV, "MLFLOW_HTTP_REQUEST_MAX_RETRIES")}
    os.environ.update({USER_ENV: admin[0], PASSWORD_ENV: admin[1], "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1"})
    if settings.cert is not None:
        os.environ[CERT_ENV] = str(settings.cert)
    try:
        yield AuthServiceClient(settings.url)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _refused(exc: Exception, what: str, admin: str) -> LedgerError:
    text = str(exc)
    if "401" in text or "Unauthorized" in text or "UNAUTHENTICATED" in text:
        return LedgerError(f"pdmctl server: {what}: the server refused the admin login of {admin}")
    if "403" in text or "PERMISSION_DENIED" in text:
        return LedgerError(f"pdmctl server: {what}: {admin} is not the server's admin")
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return LedgerError(f"pdmctl server: {what}: {first}")


def add_user(settings: ServerSettings, admin: tuple[str, str], name: str, password: str) -> str:
    """One line: the login added, or already there (LedgerError otherwise)."""
    from mlflow.exceptions import MlflowException

    with _admin(settings, admin) as client:
        try:
            client.create_user(name, password)  # type: ignore[attr-defined]
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_ALREADY_EXISTS" or "already exists" in str(exc):
                return (f"login {name} already exists on {settings.url}: unchanged (its password is changed with "
                        "MLflow's update-password call, by the admin or the user)")  # fmt: skip
            raise _refused(exc, f"adding {name}", admin[0]) from None
    return (f"login {name} added on {settings.url}: reads every sweep, writes the sweeps it creates; {name} exports "
            f"{USER_ENV}={name} and their own {PASSWORD_ENV} where they submit from")  # fmt: skip


def remove_user(settings: ServerSettings, admin: tuple[str, str], name: str) -> str:
    from mlflow.exceptions import MlflowException

    if name == admin[0]:
        raise LedgerError(f"pdmctl server: {name} is the admin login this command runs as: not removed")
    with _admin(settings, admin) as client:
        try:
            client.delete_user(name)  # type: ignore[attr-defined]
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST" or "not found" in str(exc).lower():
                return f"no login {name} on {settings.url}: nothing to remove"
            raise _refused(exc, f"removing {name}", admin[0]) from None
    return f"login {name} removed from {settings.url} (its runs stay)"
