"""Tracking URIs as printed and as refused: a login in an http(s) URI never works (MLflow's client would
take `user:password@host` for the host) and must never be printed; every command refuses such a URI in one
line that says where the login goes, from whichever source the URI comes (--tracking-uri,
MLFLOW_TRACKING_URI, a cluster profile's tracking_uri), and a database URI's password is printed as ***."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pdmctl.ledger import LedgerError, check_uri
from pdmctl.ledger.uris import redact
from tests.conftest import pdmctl
from tests.test_bad_input import snapshot
from tests.test_cli_contract import _main

SECRET = "S3cret-pw-xyz"
COMMANDS = [["status"], ["report"], ["resume"], ["doctor"], ["sweep", "backend=synthetic", "model=synthetic",
            "--dry-run"], ["cancel", "zz"], ["logs", "abc"]]  # fmt: skip


@pytest.mark.parametrize(("uri", "shown"), [
    (f"http://alice:{SECRET}@host:5000/x", "http://***@host:5000/x"),
    (f"https://alice:{SECRET}@host/", "https://***@host/"),
    ("https://alice@host/", "https://***@host/"),
    (f"postgresql+psycopg2://bob:{SECRET}@db:5432/mlflow", "postgresql+psycopg2://bob:***@db:5432/mlflow"),
    ("postgresql://bob@db/mlflow", "postgresql://bob@db/mlflow"),
    (f"mysql://bob:{SECRET}@db/m?x=1", "mysql://bob:***@db/m?x=1"),
    (f"http://alice:{SECRET}@[::1/", "***@[::1/"),  # not a URI: nothing before its last @
    (f"http://a:{SECRET}@b@host/", "http://***@host/"),
    ("sqlite:////tmp/x\ny.db", "'sqlite:////tmp/x\\ny.db'"),
    ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
])  # fmt: skip
def test_redact_shows_no_login_of_a_server_and_no_password(uri: str, shown: str) -> None:
    assert redact(uri) == shown
    assert SECRET not in redact(uri)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_every_command_refuses_a_tracking_uri_with_a_login_in_one_line(tmp_path: Path, command: list[str]) -> None:
    """The login is not printed, the line says where it goes, and nothing is written."""
    uri = f"http://alice:{SECRET}@127.0.0.1:9/"
    before = snapshot(tmp_path)
    code, stderr = _main([*command, "--tracking-uri", uri], tmp_path, {})
    assert code == 2 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines() == [
        "error: tracking URI http://***@127.0.0.1:9/: holds a login; the login of a tracking server goes in "
        "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (in the environment pdmctl runs in, which jobs "
        "inherit), never in the URI: give http://127.0.0.1:9/"
    ]
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("source", ["MLFLOW_TRACKING_URI", "profile"])
def test_a_login_in_a_tracking_uri_from_the_environment_or_a_profile_is_refused_unprinted(tmp_path: Path,
                                                                                        source: str) -> None:  # fmt: skip
    uri = f"https://alice:{SECRET}@mlflow.example.org/"
    env, args = {}, ["status"]
    if source == "profile":
        (tmp_path / "c.yaml").write_text(f"name: c\nexecutor: local\ntracking_uri: {uri}\n")
        args += ["--cluster", "c.yaml"]
    else:
        env[source] = uri
    result = pdmctl(*args, cwd=tmp_path, env=env)
    assert result.returncode == 2 and SECRET not in result.stdout + result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "tracking URI https://***@mlflow.example.org/: holds a login" in result.stderr
    assert "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD" in result.stderr


def test_a_database_password_is_printed_as_stars(tmp_path: Path) -> None:
    code, stderr = _main(["status", "--tracking-uri", f"postgresql://bob:{SECRET}@127.0.0.1:9/db"], tmp_path, {})
    assert code == 2 and SECRET not in stderr and "postgresql://bob:***@127.0.0.1:9/db" in stderr, stderr


# the characters a userinfo holds as it is (RFC 3986: unreserved, sub-delims, and ':' in the password)
USERINFO = st.text(alphabet=st.sampled_from("abcXYZ019-._~!$&'()*+,;=%é"), min_size=1, max_size=10)
HOSTS = st.sampled_from(["127.0.0.1:9", "localhost", "mlflow.example.org:5000", "[::1]:9", "h"])


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(scheme=st.sampled_from(["http", "https", "postgresql", "postgresql+psycopg2", "mysql"]), user=USERINFO,
       password=USERINFO, host=HOSTS, path=st.sampled_from(["", "/", "/db", "/x?y=1"]))  # fmt: skip
def test_redact_never_shows_a_password_of_any_uri(scheme: str, user: str, password: str, host: str,
                                                 path: str) -> None:  # fmt: skip
    secret = f"Pw{password}Q"
    uri = f"{scheme}://{user}:{secret}@{host}{path}"
    assert secret not in redact(uri)
    if scheme.startswith("http"):
        assert redact(uri) == f"{scheme}://***@{host}{path}"
        with pytest.raises(LedgerError) as refused:
            check_uri(uri)
        assert secret not in str(refused.value) and "MLFLOW_TRACKING_PASSWORD" in str(refused.value)


@settings(max_examples=15, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(command=st.sampled_from(COMMANDS), scheme=st.sampled_from(["http", "https"]), user=USERINFO,
       password=USERINFO, host=HOSTS, via=st.sampled_from(["option", "environment"]))  # fmt: skip
def test_no_command_prints_the_login_of_a_tracking_uri(tmp_path_factory: pytest.TempPathFactory, command: list[str],
                                                      scheme: str, user: str, password: str, host: str,
                                                      via: str) -> None:  # fmt: skip
    """Whatever the login and the command: exit 2, one line, the password nowhere, nothing written."""
    secret = f"Pw{password}Q"
    uri = f"{scheme}://{user}:{secret}@{host}/"
    assume(secret not in host)
    work = tmp_path_factory.mktemp("uri")
    before = snapshot(work)
    args = [*command, "--tracking-uri", uri] if via == "option" else command
    code, stderr = _main(args, work, {} if via == "option" else {"MLFLOW_TRACKING_URI": uri})
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert secret not in stderr and "MLFLOW_TRACKING_USERNAME" in stderr, stderr
    assert snapshot(work) == before
    shutil.rmtree(work, ignore_errors=True)
