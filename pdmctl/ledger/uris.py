"""Tracking URIs: which store a URI names, whether it can be used (checked before anything is
written), the default ./mlflow.db, and how a URI is printed (`redact`: never a password)."""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pdmctl.ledger.records import LedgerError


def default_tracking_uri(cwd: Path | None = None) -> str:
    return f"sqlite:///{(cwd or Path.cwd()).resolve() / 'mlflow.db'}"


def resolve_tracking_uri(cli_uri: str | None, profile_uri: str | None) -> str:
    """--tracking-uri, then MLFLOW_TRACKING_URI, then the cluster profile, then ./mlflow.db; checked."""
    if cli_uri is not None and not cli_uri.strip():  # `--tracking-uri "$UNSET"`: not ./mlflow.db by surprise
        raise LedgerError("--tracking-uri: empty (an unset variable?); give a URI, or leave the option out "
                          "for the default")  # fmt: skip
    uri = cli_uri or os.environ.get("MLFLOW_TRACKING_URI") or profile_uri or default_tracking_uri()
    check_uri(uri)
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):  # make relative paths absolute
        try:
            uri = f"sqlite:///{Path(uri.removeprefix('sqlite:///')).resolve()}"
        except (RuntimeError, OSError) as exc:  # a loop of symbolic links
            raise LedgerError(f"tracking URI {redact(uri)}: cannot be resolved ({exc})") from exc
    return uri


LOGIN_HINT = ("the login of a tracking server goes in MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
              "(in the environment pdmctl runs in, which jobs inherit), never in the URI")  # fmt: skip


def check_uri(uri: str) -> None:
    """Raise LedgerError (one line) for a URI no store answers to; looks at the text only."""
    try:
        parsed = urlparse(uri)
        scheme = parsed.scheme.split("+")[0]
        if scheme in ("http", "https"):
            parsed.port  # noqa: B018  (raises for a port that is no number)
    except ValueError as exc:
        raise LedgerError(f"tracking URI {redact(uri)}: not a URI ({exc})") from None
    if scheme in ("http", "https") and "@" in parsed.netloc:
        # MLflow's client sends no login from the URI: it would take `user:password@host` for the host name
        raise LedgerError(f"tracking URI {redact(uri)}: holds a login; {LOGIN_HINT}: give "
                          f"{scheme}://{parsed.netloc.rpartition('@')[2]}{parsed.path}")  # fmt: skip
    if scheme == "sqlite":
        if not uri.startswith("sqlite:///") or not uri.removeprefix("sqlite:///").strip("/"):
            raise LedgerError(f"tracking URI {redact(uri)}: a SQLite store is sqlite:///PATH (three slashes, "
                              "then the file; four for an absolute path)")  # fmt: skip
        if uri.removeprefix("sqlite:///").split("?")[0] in (":memory:", "file::memory:") or "mode=memory" in uri:
            raise LedgerError(f"tracking URI {redact(uri)}: a SQLite store in memory holds no runs (each process "
                              "gets its own, empty); name a file, sqlite:///PATH")  # fmt: skip
    elif scheme in ("http", "https"):
        if not parsed.hostname:
            raise LedgerError(f"tracking URI {redact(uri)}: no host")
    elif not is_database_uri(uri):
        raise LedgerError(
            f"tracking URI {redact(uri)}: unsupported scheme {parsed.scheme!r} "
            "(use sqlite:///, postgresql://, http://)"
        )


def is_database_uri(uri: str) -> bool:
    return urlparse(uri).scheme.split("+")[0] in ("sqlite", "postgresql", "mysql", "mssql")


def sqlite_path(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def check_reachable(uri: str, *, timeout: float = 5.0) -> None:
    """Raise LedgerError (one line) unless the store can be used; writes nothing."""
    scheme = urlparse(uri).scheme
    path = sqlite_path(uri)
    if path is not None:
        if not path.parent.is_dir():
            raise LedgerError(f"tracking URI {redact(uri)}: directory {path.parent} does not exist")
        if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise LedgerError(f"tracking URI {redact(uri)}: {path} is not writable")
        return
    if is_database_uri(uri):
        import sqlalchemy

        try:
            engine = sqlalchemy.create_engine(uri, connect_args=_connect_args(uri, timeout))
        except ImportError as exc:
            hint = ("name one that is, e.g. postgresql+psycopg2:// (pip install 'pdmctl[cluster]')"
                    if uri.startswith("postgresql") else "install it")  # fmt: skip
            raise LedgerError(f"tracking URI {_redact(uri)}: its database driver is not installed "
                              f"({_first_line(exc)}); {hint}") from exc  # fmt: skip
        except Exception as exc:
            raise LedgerError(f"tracking URI {_redact(uri)}: cannot be used ({_first_line(exc)})") from exc
        try:
            with engine.connect() as conn:
                conn.execute(sqlalchemy.text("SELECT 1"))
        except Exception as exc:
            raise LedgerError(f"tracking URI {_redact(uri)}: cannot connect ({_first_line(exc)})") from exc
        return
    if scheme in ("http", "https"):
        import urllib.request

        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout, context=tls_context()) as resp:
                if resp.status != 200:
                    raise LedgerError(f"tracking URI {redact(uri)}: /health answered {resp.status}")
        except LedgerError:
            raise
        except Exception as exc:
            hint = (f"; trust its certificate with {CERT_ENV}=FILE" if "CERTIFICATE_VERIFY_FAILED" in str(exc) else "")
            raise LedgerError(f"tracking URI {redact(uri)}: not reachable ({_first_line(exc)}){hint}") from exc
        return
    check_uri(uri)


def ledger_exists(uri: str) -> bool:
    """Whether reading the ledger would find anything (an absent SQLite file has no runs yet).

    A SQLite store whose directory is missing is a mistaken path, not an empty store: LedgerError.
    """
    path = sqlite_path(uri)
    if path is not None and not path.parent.is_dir():
        raise LedgerError(f"tracking URI {redact(uri)}: directory {path.parent} does not exist")
    return path is None or path.exists()


def _connect_args(uri: str, timeout: float) -> dict[str, Any]:
    if uri.startswith("sqlite"):
        return {"timeout": timeout}
    if uri.startswith("postgresql"):
        return {"connect_timeout": int(timeout)}
    return {}



def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


CERT_ENV = "MLFLOW_TRACKING_SERVER_CERT_PATH"  # MLflow's client trusts this certificate (file or bundle)


def tls_context(cafile: str | os.PathLike | None = None) -> ssl.SSLContext:
    """How pdmctl's own calls to a tracking server check its certificate: as MLflow's client does, against
    `cafile`, else $MLFLOW_TRACKING_SERVER_CERT_PATH, else the system's authorities."""
    cafile = cafile or os.environ.get(CERT_ENV) or None
    try:
        return ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as exc:
        raise LedgerError(f"{CERT_ENV}={cafile}: not a certificate file ({exc})") from None


def redact(uri: str) -> str:
    """A URI as printed: the login of an http(s) URI (`http://USER:PASSWORD@host`) as ***, the password of a
    database URI (`postgresql://user:PASSWORD@host`) as ***; control characters escaped (one line)."""
    try:
        parsed = urlparse(uri)
    except ValueError:
        parsed = None
    shown = uri
    if parsed is not None and "@" in parsed.netloc:
        userinfo, _, host = parsed.netloc.rpartition("@")
        if parsed.scheme.split("+")[0] in ("http", "https"):
            hidden = "***"
        else:
            user, colon, _password = userinfo.partition(":")
            hidden = f"{user}:***" if colon else user
        shown = uri.replace(parsed.netloc, f"{hidden}@{host}", 1)
    elif "@" in uri and parsed is None:  # unparseable: keep nothing before the last @
        shown = "***@" + uri.rpartition("@")[2]
    return shown if shown.isprintable() else ascii(shown)


_redact = redact  # the name the ledger's modules import
