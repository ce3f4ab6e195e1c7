"""`pdmctl server start` and where it listens: an address other machines reach (a wildcard, a network
address) over plain HTTP, where every call carries a login in clear, is refused in one line before anything
starts or is written, unless --tls serves HTTPS or --insecure accepts it (said in one line); and the
tracking_uri it prints for the cluster profile names an address the nodes reach, never 0.0.0.0 or ::."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdmctl.cli import app
from pdmctl.ledger import LedgerError
from pdmctl.ledger import server as srv
from pdmctl.ledger.bind import check_bind, is_loopback, reachable_name
from tests.test_bad_input import snapshot

LOGIN = {"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": "pw-7Hq2-never-in-a-file"}
BEYOND_LOOPBACK = ["0.0.0.0", "::", "10.0.0.5", "fd00::5", "node1.example.org", ""]
LOOPBACK = ["127.0.0.1", "127.0.0.2", "localhost", "localhost.localdomain", "::1", "[::1]"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def no_start(monkeypatch: pytest.MonkeyPatch) -> list:
    """`server.start` replaced: the settings it would have started with, and nothing started."""
    started: list = []

    def fake_start(settings):
        started.append(settings)
        return [f"mlflow server at {settings.url} (a test's stand-in)"]

    monkeypatch.setattr(srv, "start", fake_start)
    monkeypatch.setattr(socket, "getfqdn", lambda name="": "head.cluster.example.org")
    for key, value in LOGIN.items():
        monkeypatch.setenv(key, value)
    return started


@pytest.mark.parametrize("host", BEYOND_LOOPBACK)
def test_a_bind_beyond_loopback_over_plain_http_is_refused_in_one_line_before_anything_is_written(
    tmp_path: Path, host: str, no_start: list
) -> None:
    """0.0.0.0, ::, a network address or a host name with --no-tls: exit 2, one line naming --tls and
    --insecure, the login not printed, nothing started, the server's directory not made."""
    state = tmp_path / "s"
    before = snapshot(tmp_path)
    result = CliRunner().invoke(app, ["server", "start", "--dir", str(state), "--host", host,
                                      "--port", str(_free_port()), "--no-tls"])  # fmt: skip
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "--tls" in lines[0] and "--insecure" in lines[0] and "in clear" in lines[0]
    assert LOGIN["MLFLOW_TRACKING_PASSWORD"] not in result.output
    assert no_start == [] and not state.exists() and snapshot(tmp_path) == before


def test_a_refused_bind_starts_nothing_in_a_real_process(tmp_path: Path) -> None:
    """The console script itself (no stand-in for the start): `--host 0.0.0.0 --no-tls` is refused in one line and
    leaves no directory, so no PostgreSQL or MLflow could have started."""
    from tests.conftest import pdmctl

    state = tmp_path / "s"
    result = pdmctl("server", "start", "--dir", str(state), "--host", "0.0.0.0", "--port", str(_free_port()),
                    "--no-tls", env=LOGIN, cwd=tmp_path)  # fmt: skip
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stdout + result.stderr
    assert "--host 0.0.0.0 over plain HTTP" in lines[0] and "--insecure" in lines[0]
    assert sorted(tmp_path.iterdir()) == []


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5"])
def test_insecure_starts_a_plain_http_bind_beyond_loopback_and_says_logins_cross_in_clear(
    tmp_path: Path, host: str, no_start: list
) -> None:
    result = CliRunner().invoke(app, ["server", "start", "--dir", str(tmp_path / "s"), "--host", host,
                                      "--port", "5123", "--insecure"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert len(no_start) == 1 and no_start[0].host == host and not no_start[0].serves_tls
    warned = [line for line in result.stdout.splitlines() if "--insecure" in line]
    assert len(warned) == 1 and "crosses the network in clear" in warned[0], result.stdout


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_the_printed_tracking_uri_of_a_wildcard_bind_names_this_host_not_the_wildcard(
    tmp_path: Path, host: str, no_start: list
) -> None:
    result = CliRunner().invoke(app, ["server", "start", "--dir", str(tmp_path / "s"), "--host", host,
                                      "--port", "5123", "--insecure"])  # fmt: skip
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("profile: tracking_uri:")]
    assert line.startswith("profile: tracking_uri: http://head.cluster.example.org:5123 "), line
    assert "0.0.0.0" not in line and "::" not in line


@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_binds_need_neither_tls_nor_insecure_and_print_no_warning(
    tmp_path: Path, host: str, no_start: list
) -> None:
    result = CliRunner().invoke(app, ["server", "start", "--dir", str(tmp_path / "s"), "--host", host,
                                      "--port", "5123"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert len(no_start) == 1 and "in clear" not in result.output


@pytest.mark.parametrize("host", BEYOND_LOOPBACK)
def test_a_bind_beyond_loopback_serves_https_unless_told_otherwise(tmp_path: Path, host: str, no_start: list) -> None:
    """Without --tls or --no-tls, a bind other machines reach starts with TLS (a certificate made in DIR/tls),
    whatever an earlier start on loopback served; the profile's URI is https."""
    result = CliRunner().invoke(app, ["server", "start", "--dir", str(tmp_path / "s"), "--host", host,
                                      "--port", "5123"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert len(no_start) == 1 and no_start[0].serves_tls and "in clear" not in result.output
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("profile: tracking_uri:")]
    assert line.startswith("profile: tracking_uri: https://"), line


def test_tls_binds_beyond_loopback_without_insecure(tmp_path: Path, no_start: list) -> None:
    result = CliRunner().invoke(app, ["server", "start", "--dir", str(tmp_path / "s"), "--host", "0.0.0.0",
                                      "--port", "5123", "--tls"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert len(no_start) == 1 and no_start[0].serves_tls and "in clear" not in result.output
    assert "profile: tracking_uri: https://head.cluster.example.org:5123 " in result.stdout


@pytest.mark.parametrize(("host", "tls", "want"), [
    ("0.0.0.0", False, "http://head.cluster.example.org:5000"),
    ("::", False, "http://head.cluster.example.org:5000"),
    ("0.0.0.0", True, "https://head.cluster.example.org:5000"),
    ("10.0.0.5", False, "http://10.0.0.5:5000"),
    ("fd00::5", True, "https://[fd00::5]:5000"),
    ("127.0.0.1", False, "http://127.0.0.1:5000"),
    ("mlflow-head", False, "http://mlflow-head:5000"),
])  # fmt: skip
def test_profile_uri_names_an_address_the_nodes_reach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host: str, tls: bool, want: str
) -> None:
    """A wildcard bind is named by this host's fully qualified name; any other bind by itself, an IPv6
    literal in brackets."""
    monkeypatch.setattr(socket, "getfqdn", lambda name="": "head.cluster.example.org")
    assert srv.make_settings(tmp_path, host=host, port=5000, tls=tls).profile_uri == want


@pytest.mark.parametrize("fqdn", ["localhost", "localhost.localdomain", "1.0.0.127.in-addr.arpa", ""])
def test_a_wildcard_bind_falls_back_to_the_host_name_where_the_qualified_name_is_loopback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fqdn: str
) -> None:
    monkeypatch.setattr(socket, "getfqdn", lambda name="": fqdn)
    monkeypatch.setattr(socket, "gethostname", lambda: "head01")
    assert reachable_name() == "head01"
    assert srv.make_settings(tmp_path, host="0.0.0.0", port=5000).profile_uri == "http://head01:5000"


def test_which_binds_are_refused_without_tls_or_insecure() -> None:
    for host in LOOPBACK:
        assert is_loopback(host)
        check_bind(host, serves_tls=False, insecure=False)
    for host in BEYOND_LOOPBACK:
        assert not is_loopback(host)
        with pytest.raises(LedgerError, match=r"over plain HTTP.*--tls.*--insecure"):
            check_bind(host, serves_tls=False, insecure=False)
        check_bind(host, serves_tls=True, insecure=False)
        check_bind(host, serves_tls=False, insecure=True)
