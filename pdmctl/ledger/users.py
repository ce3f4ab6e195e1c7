"""The logins of a shared `pdmctl server`: added and removed by its admin through MLflow's auth client, and
the sharing of a sweep by its owner.

A login the admin adds has no access to the sweeps of others: the server's basic_auth.ini sets MLflow's
`default_permission` to NO_PERMISSIONS. It MANAGEs the experiments (sweeps) it creates itself (MLflow grants
their creator that), and pdmctl records it as their owner (the experiment tag `pdmctl.owner`); a sweep of
another login's name is refused in one line, never read as its own. The owner shares a sweep with named
logins (`share`): EDIT (they read it and may sweep, resume, cancel it; the tag `pdmctl.shared_with`) or READ
(status and report only). The server's admin reads and writes everything, as MLflow lets it; pdmctl still
refuses its sweep, resume, cancel of a sweep it does not own. Each person exports their own
MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD where they submit from.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence

from pdmctl.ledger.records import TAG_OWNER, TAG_SHARED, LedgerError, login_list, tracking_login
from pdmctl.ledger.server import CERT_ENV, PASSWORD_ENV, USER_ENV, ServerSettings, healthy


def _auth_client_class(command: str) -> type:
    """MLflow's AuthServiceClient. It is imported with MLflow's auth app (Flask, Flask-WTF), which the full
    `mlflow` brings (the [server] extra) and pdmctl's own `mlflow-skinny` does not: one line naming the extra."""
    import warnings

    try:
        with warnings.catch_warnings():  # its server's modules, imported with it, warn of their own dependencies
            warnings.simplefilter("ignore")
            from mlflow.server.auth.client import AuthServiceClient
    except ImportError as exc:
        raise LedgerError(f"{command}: MLflow's auth client comes with its server, not installed in "
                          f"{sys.executable} ({exc}): pip install 'pdmctl[server]'") from None  # fmt: skip
    return AuthServiceClient


@contextlib.contextmanager
def _admin(settings: ServerSettings, admin: tuple[str, str]) -> Iterator[object]:
    """MLflow's auth client for the server, logged in as its admin (the login in this process's environment,
    as MLflow's client reads it), trusting the server's certificate where it serves HTTPS."""
    auth_client = _auth_client_class("pdmctl server user")

    if not healthy(settings.url, cafile=settings.cert):
        raise LedgerError(f"pdmctl server: nothing answers at {settings.url}: start the server first "
                          "(pdmctl server start), or name its --host/--port")  # fmt: skip
    saved = {name: os.environ.get(name) for name in (USER_ENV, PASSWORD_ENV, CERT_ENV, "MLFLOW_HTTP_REQUEST_MAX_RETRIES")}
    os.environ.update({USER_ENV: admin[0], PASSWORD_ENV: admin[1], "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1"})
    if settings.cert is not None:
        os.environ[CERT_ENV] = str(settings.cert)
    try:
        yield auth_client(settings.url)
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
    return (f"login {name} added on {settings.url}: reads and writes the sweeps it creates, and those their owners "
            f"share with it (pdmctl server share), no other; {name} exports {USER_ENV}={name} and their own "
            f"{PASSWORD_ENV} where they submit from")  # fmt: skip


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


def share(uri: str, sweep: str, logins: Sequence[str], edit: bool = True) -> list[str]:
    """The owner of `sweep` (this process's login) lets `logins` read it, and with `edit` write it too (MLflow's
    EDIT on its experiment, and their names in `pdmctl.shared_with`, which pdmctl's owner check reads); READ
    takes a login's writing back. Only the sweep's MANAGErs (its owner, the admin) may: MLflow refuses others.
    One line per login (LedgerError, one line, where nothing can be shared)."""
    from mlflow.exceptions import MlflowException

    from pdmctl.ledger.client import ClientLedger
    from pdmctl.ledger.uris import _first_line, _redact, is_database_uri

    auth_client = _auth_client_class("pdmctl server share")
    login = tracking_login()
    if is_database_uri(uri):
        raise LedgerError(f"pdmctl server share: {_redact(uri)} is a database store, which has no logins: sharing "
                          "is for a tracking server's sweeps (--tracking-uri http(s)://...)")  # fmt: skip
    if login is None:
        raise LedgerError(f"pdmctl server share: {USER_ENV} not set: a sweep is shared by its owner, logged in")
    ledger = ClientLedger(uri)
    exp = ledger._by_name(sweep)  # one of another login's that this one cannot read: SweepOwnerError
    if exp is None:
        raise LedgerError(f"pdmctl server share: no sweep {sweep!r} on {_redact(uri)}")
    owner = exp.tags.get(TAG_OWNER) or login
    permission = "EDIT" if edit else "READ"
    client = auth_client(uri)
    lines = []
    for name in dict.fromkeys(logins):
        if name == owner:
            lines.append(f"{name} owns sweep {sweep}: unchanged")
            continue
        try:
            _grant(client, name, exp.experiment_id, permission)
        except MlflowException as exc:
            said = _first_line(exc)
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST" or "not found" in said.lower():
                raise LedgerError(f"pdmctl server share: no login {name} on {_redact(uri)}: nothing shared "
                                  "with it (the admin adds logins: pdmctl server user add)") from None  # fmt: skip
            if exc.error_code == "PERMISSION_DENIED" or "403" in said:
                raise LedgerError(f"pdmctl server share: {login} may not share sweep {sweep!r}: it belongs to login "
                                  f"{owner} (its owner or the server's admin shares it)") from None  # fmt: skip
            raise LedgerError(f"pdmctl server share: sweep {sweep!r} with {name}: {said[:300]}") from None
        lines.append(f"sweep {sweep} (owner {owner}) shared with {name}: "
                     + ("reads it and may sweep, resume and cancel it" if edit else "reads it (status, report)"))
    shared = [n for n in login_list(exp.tags.get(TAG_SHARED)) if n not in logins]
    shared += [n for n in dict.fromkeys(logins) if edit and n != owner]
    ledger.client.set_experiment_tag(exp.experiment_id, TAG_SHARED, json.dumps(shared))
    return lines


def _grant(client, name: str, experiment_id: str, permission: str) -> None:
    """`permission` for `name` on the experiment, replacing one it had (MLflow's auth client: the grant calls
    of MLflow 3.17 and later, the experiment-permission calls before)."""
    from mlflow.exceptions import MlflowException

    if not hasattr(client, "grant_user_permission"):  # MLflow before 3.17
        try:
            client.create_experiment_permission(experiment_id, name, permission)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            client.update_experiment_permission(experiment_id, name, permission)
        return
    try:
        client.grant_user_permission(name, "experiment", experiment_id, permission)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        client.revoke_user_permission(name, "experiment", experiment_id)
        client.grant_user_permission(name, "experiment", experiment_id, permission)
