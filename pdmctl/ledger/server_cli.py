"""`pdmctl server start|stop|status`, `pdmctl server user add|remove` and `pdmctl server share`: the commands of
pdmctl.ledger.server and pdmctl.ledger.users."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from pdmctl.terminal import console, fail
from pdmctl.terminal import guard as _guard

app = typer.Typer(
    name="server",
    help="An MLflow tracking server with a login (MLflow's basic-auth app) on a PostgreSQL that runs as you, no "
    "root (the pgserver wheel: pip install 'pdmctl\\[server]'). The admin's login is MLFLOW_TRACKING_USERNAME / "
    "MLFLOW_TRACKING_PASSWORD from the environment, never written to a file. Each action is idempotent.",
    no_args_is_help=True,
)
users = typer.Typer(help="Logins for the people who share the server (run by its admin).", no_args_is_help=True)
app.add_typer(users, name="user")

DirOpt = Annotated[
    Path | None,
    typer.Option("--dir", help="The server's state, on a local disk (default: $PDMCTL_SERVER_DIR, "
                 "~/.local/share/pdmctl/server)."),
]  # fmt: skip
HostOpt = Annotated[
    str | None,
    typer.Option(help="Address to bind: one the compute nodes reach, never a public one (default: the last "
                 "start's, else 127.0.0.1); on start, one beyond loopback (0.0.0.0, ::, a network address) serves "
                 "HTTPS unless --insecure (with --no-tls, refused without it)."),
]  # fmt: skip
PortOpt = Annotated[int | None, typer.Option(help="TCP port of the tracking server (default: the last start's, else 5000).")]
TlsOpt = Annotated[
    bool | None,
    typer.Option("--tls/--no-tls", help="Serve HTTPS, with a certificate made in DIR/tls on the first start; the "
                 "clients trust it with MLFLOW_TRACKING_SERVER_CERT_PATH (default: on a bind beyond loopback; on "
                 "loopback, as the last start).", show_default=False),
]  # fmt: skip
CertOpt = Annotated[Path | None, typer.Option(help="Serve HTTPS with this certificate (PEM).")]
KeyOpt = Annotated[Path | None, typer.Option(help="The key of --tls-cert (PEM).")]


def _settings(directory: Path | None, host: str | None, port: int | None, tls: bool | None,
              tls_cert: Path | None = None, tls_key: Path | None = None, insecure: bool = False,
              **options: object):  # fmt: skip
    """The call's settings: what it names, else what the directory's last start recorded, else the defaults.
    A bind beyond loopback serves HTTPS unless told otherwise (--no-tls with --insecure)."""
    from pdmctl.ledger import server as srv
    from pdmctl.ledger.bind import is_loopback

    settings = srv.make_settings(directory)
    last = srv.last_start(settings)
    bound = host if host is not None else last.get("host", "127.0.0.1")
    if tls is None and not insecure and not is_loopback(str(bound)):
        tls = True  # other machines reach it: HTTPS, whatever the last start served
    return srv.make_settings(
        directory,
        host=bound,
        port=port if port is not None else last.get("port", 5000),
        tls=tls if tls is not None else bool(last.get("tls", False)),
        tls_cert=tls_cert if tls_cert is not None or tls is not None else _path(last.get("tls_cert")),
        tls_key=tls_key if tls_key is not None or tls is not None else _path(last.get("tls_key")),
        **options,
    )


def _path(value: object) -> Path | None:
    return Path(value) if isinstance(value, str) and value else None


def _say(lines: list[str]) -> None:
    for line in lines:
        console.print(line, highlight=False, markup=False, soft_wrap=True)


@app.command()
def start(
    directory: DirOpt = None,
    host: HostOpt = None,
    port: PortOpt = None,
    workers: Annotated[int, typer.Option(help="MLflow's server workers.")] = 4,
    artifacts: Annotated[Path | None, typer.Option(help="Artifact store directory (default: DIR/artifacts).")] = None,
    allowed_hosts: Annotated[
        str | None, typer.Option(help="Host headers MLflow accepts (default: HOST, localhost, with and without the port).")
    ] = None,
    tls: TlsOpt = None,
    tls_cert: CertOpt = None,
    tls_key: KeyOpt = None,
    insecure: Annotated[
        bool, typer.Option("--insecure", help="Serve plain HTTP on an address other machines reach (--host beyond "
                           "loopback without --tls): every login then crosses the network in clear.")
    ] = False,
) -> None:
    """Start PostgreSQL and the MLflow server (what is not running), and check the admin's login."""
    from pdmctl.ledger import server as srv
    from pdmctl.ledger.bind import check_bind, insecure_note

    with _guard():
        settings = _settings(directory, host, port, tls, tls_cert, tls_key, insecure, workers=workers,
                             artifacts=artifacts, allowed_hosts=allowed_hosts)  # fmt: skip
        check_bind(settings.host, settings.serves_tls, insecure)  # before anything starts or is written
        note = insecure_note(settings.host, settings.serves_tls)
        if note is not None:
            _say([note])
        lines = srv.start(settings)
    _say(lines)
    _say([f"profile: tracking_uri: {settings.profile_uri} (or a name the nodes resolve); the jobs log in with "
          f"{srv.USER_ENV} / {srv.PASSWORD_ENV} from the environment you submit from"])  # fmt: skip
    if settings.cert is not None:
        _say([f"the clients trust its certificate with {srv.CERT_ENV}={settings.cert} (a copy where the nodes read it)"])


@app.command()
def stop(directory: DirOpt = None, host: HostOpt = None, port: PortOpt = None) -> None:
    """Stop the MLflow server and PostgreSQL this directory started."""
    from pdmctl.ledger import server as srv

    with _guard():
        lines = srv.stop(_settings(directory, host, port, None))
    _say(lines)


@app.command()
def status(directory: DirOpt = None, host: HostOpt = None, port: PortOpt = None, tls: TlsOpt = None) -> None:
    """What runs: the MLflow server (answering or not) and PostgreSQL; exit 1 when either is down."""
    from pdmctl.ledger import server as srv

    with _guard():
        up, lines = srv.status(_settings(directory, host, port, tls))
    _say(lines)
    if not up:
        raise typer.Exit(1)


NameArg = Annotated[str, typer.Argument(metavar="NAME", help="The login's user name.")]


@users.command("add")
def user_add(
    name: NameArg,
    password_stdin: Annotated[
        bool, typer.Option("--password-stdin", help="Read the new login's password from standard input (one line).")
    ] = False,
    directory: DirOpt = None,
    host: HostOpt = None,
    port: PortOpt = None,
    tls: TlsOpt = None,
) -> None:
    """Add a login: it reads and writes the sweeps it creates (MLflow's MANAGE on its own) and those shared with
    it (pdmctl server share), no other (the server's default: NO_PERMISSIONS). Its password is asked for twice,
    or read from standard input; never an argument."""
    from pdmctl.ledger import server as srv
    from pdmctl.ledger import users as usr

    with _guard():
        settings = _settings(directory, host, port, tls)
        admin = srv.credentials()
        srv.check_login_text(name, "x" * srv.PASSWORD_MIN, user_env="NAME")
        if password_stdin:
            password = sys.stdin.readline().rstrip("\r\n")
        elif sys.stdin.isatty():
            password = typer.prompt(f"password for {name}", hide_input=True, confirmation_prompt=True)
        else:
            fail("pdmctl server user add: no terminal to ask the password on: pass --password-stdin and give it on "
                 "standard input")  # fmt: skip
        srv.check_login_text(name, password, user_env="NAME", password_env="the password")
        line = usr.add_user(settings, admin, name, password)
    _say([line])


@users.command("remove")
def user_remove(name: NameArg, directory: DirOpt = None, host: HostOpt = None, port: PortOpt = None,
                tls: TlsOpt = None) -> None:  # fmt: skip
    """Remove a login (its runs stay)."""
    from pdmctl.ledger import server as srv
    from pdmctl.ledger import users as usr

    with _guard():
        settings = _settings(directory, host, port, tls)
        line = usr.remove_user(settings, srv.credentials(), name)
    _say([line])


@app.command()
def share(
    sweep: Annotated[str, typer.Argument(metavar="SWEEP", help="A sweep you own (created under your login).")],
    logins: Annotated[list[str], typer.Argument(metavar="LOGIN...", help="The logins to share it with.")],
    read: Annotated[bool, typer.Option("--read", help="Let them read it only (status, report), not sweep, resume "
                                       "or cancel it.")] = False,
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="Cluster profile under clusters/ (or a path).")] = "local",
    tracking_uri: Annotated[
        str | None, typer.Option("--tracking-uri", help="The tracking server (default: $MLFLOW_TRACKING_URI, the "
                                 "profile's).")
    ] = None,
) -> None:
    """Share a sweep you own with other logins (run by its owner, with your own MLFLOW_TRACKING_USERNAME /
    MLFLOW_TRACKING_PASSWORD): they may read it and sweep, resume and cancel it (MLflow's EDIT on its
    experiment), or with --read only read it. A sweep is its creator's alone until then: another login can
    neither read it nor submit under its name; sharing again with --read takes the writing back."""
    from pdmctl.ledger import users as usr
    from pdmctl.orchestrate import make_context

    with _guard():
        ctx = make_context(cluster, tracking_uri)
        lines = usr.share(ctx.tracking_uri, sweep, logins, edit=not read)
    _say(lines)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="server")
