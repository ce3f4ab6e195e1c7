"""Where `pdmctl server` listens and how the nodes name it: a bind that other machines reach over plain HTTP
is refused unless asked for (--insecure), and a wildcard bind (0.0.0.0, ::) is named by this host's name in
the tracking_uri a cluster profile is given, never by the wildcard, which names no address a node reaches."""

from __future__ import annotations

import ipaddress
import socket

from pdmctl.ledger.records import LedgerError

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})  # every interface of the host


def is_wildcard(host: str) -> bool:
    return host.strip().lower() in WILDCARD_HOSTS


def is_loopback(host: str) -> bool:
    """Whether an address to bind reaches this machine alone: localhost (localhost.localdomain, x.localhost),
    127.0.0.0/8, ::1."""
    name = host.strip().strip("[]").lower().rstrip(".")
    if name.split(".")[0] == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:  # another host name: taken to reach beyond this machine
        return False


def netloc(host: str) -> str:
    """A host as a URL names it: an IPv6 literal in brackets."""
    bare = host.strip("[]")
    try:
        return f"[{bare}]" if ipaddress.ip_address(bare).version == 6 else bare
    except ValueError:
        return host


def reachable_name() -> str:
    """This host's name as the nodes resolve it: its fully qualified name, else its host name."""
    fqdn = socket.getfqdn()
    if fqdn and not is_loopback(fqdn) and not is_wildcard(fqdn) and not fqdn.endswith(".arpa"):
        return fqdn
    return socket.gethostname() or fqdn or "localhost"


def check_bind(host: str, serves_tls: bool, insecure: bool) -> None:
    """Refuse (LedgerError, one line) a bind that other machines reach (a wildcard or a non-loopback
    address) over plain HTTP, where every call carries a login in clear, unless `insecure` accepts that."""
    if serves_tls or insecure or is_loopback(host):
        return
    shown = host if host.isprintable() and host else ascii(host)
    raise LedgerError(f"pdmctl server: --host {shown} over plain HTTP: other machines reach it and every "
                      "call carries a login in clear; pass --tls (HTTPS, a certificate made in DIR/tls), or "
                      "--insecure to serve plain HTTP on a network you trust")


def insecure_note(host: str, serves_tls: bool) -> str | None:
    """The line a plain-HTTP bind that other machines reach is started with (--insecure); None otherwise."""
    if serves_tls or is_loopback(host):
        return None
    return (f"warning: --insecure: plain HTTP on {host or repr(host)}, which other machines reach: every "
            "login crosses the network in clear (--tls serves HTTPS)")
