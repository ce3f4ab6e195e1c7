"""The tracked files speak of the project itself: no ticket or process references ("issue 12", "item 3",
"stop 35", a "rehearsal", a change that "landed", a development "session"), no paths to files outside the
repository, and the files a published project carries (LICENSE, CHANGELOG.md, CONTRIBUTING.md) are there."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

PROCESS_WORDS = re.compile(
    r"\b(?:issues? #?\d|issue-\d|issue's|the issue\b(?! tracking)|items? \d|stops? \d+(?![\d>])|review (?:item )?\d"
    r"|round (?:two|three|four|five)\b|rehears|landed\b|landing\b|sessions?\b)",
    re.IGNORECASE,
)
# "session" where it is the operating system's: a process session (setsid), as Ray's and vLLM's workers start
ALLOWED_SESSION = re.compile(r"process sessions?\b|\bsessions? of (its|their) own\b", re.IGNORECASE)
OUTSIDE = re.compile(r"(?:\.\./|\b)shared/(?:papers|docs)\b|\.\./shared\b")
REQUIRED = ("LICENSE", "CHANGELOG.md", "CONTRIBUTING.md")


def tracked_text_files() -> dict[str, str]:
    """Every tracked file that is UTF-8 text, by its path in the repository."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    return _read_tracked()


@functools.cache
def _read_tracked() -> dict[str, str]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = {}
    for name in names.decode().split("\0"):
        path = ROOT / name
        if not name or name == THIS or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            files[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return files


def offending_lines(files: dict[str, str], pattern: re.Pattern[str], allowed: re.Pattern[str] | None = None) -> list[str]:
    found = []
    for name, text in files.items():
        if not pattern.search(text):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for match in pattern.finditer(line):
                if match.group(0).lower().startswith("session") and allowed is not None and allowed.search(line):
                    continue
                found.append(f"{name}:{number}: {line.strip()[:160]}")
                break
    return found


def test_no_tracked_file_speaks_of_tickets_or_the_development_process() -> None:
    bad = offending_lines(tracked_text_files(), PROCESS_WORDS, ALLOWED_SESSION)
    assert not bad, "say what the code or document guarantees, not which ticket or step produced it:\n" + "\n".join(bad)


def test_no_tracked_file_points_outside_the_repository() -> None:
    files = {name: text for name, text in tracked_text_files().items() if "shared" in text}
    bad = offending_lines(files, OUTSIDE)
    assert not bad, "cite the paper as 'arXiv 2607.10848, §N'; no paths outside the repository:\n" + "\n".join(bad)


@pytest.mark.parametrize("name", REQUIRED)
def test_the_project_carries_its_license_changelog_and_contributing_guide(name: str) -> None:
    path = ROOT / name
    assert path.is_file() and path.read_text(encoding="utf-8").strip(), f"{name} is missing or empty"


def test_the_license_is_the_one_pyproject_names() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^license = "Apache-2.0"', pyproject, re.MULTILINE)
    license_text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text


def test_the_check_finds_what_it_is_for() -> None:
    """The patterns catch each kind of reference they exist for and leave the legitimate words alone."""
    sample = {
        "a.md": "fixed in issue 26, item 4\nCI stop 35 failed\nthe CI rehearsal\nonce it landed\nthe first GPU session\n"
        "the issue's goal",
        "b.py": "# a worker in a session of its own\n# engine cores in process sessions\nstart_new_session=True\n"
        "# pg_ctlcluster 15 main stop 2>/dev/null\n# the statements the driver issues per trial",
        "c.md": "see ../shared/docs/MATH.md\nthe paper (shared/papers)\n/shared/models on the cluster",
    }
    process = offending_lines(sample, PROCESS_WORDS, ALLOWED_SESSION)
    assert [line.split(":")[1] for line in process] == ["1", "2", "3", "4", "5", "6"]
    assert all(line.startswith("a.md") for line in process)
    outside = offending_lines(sample, OUTSIDE)
    assert [line.split(":", 2)[:2] for line in outside] == [["c.md", "1"], ["c.md", "2"]]
