"""Each command's exit codes, as its `--help` lists them (above its examples).

Every command shares two: 2 for bad input (a mistyped option or value, an unknown sweep, run, file or profile,
a store that cannot be read: one line on stderr, nothing done) and 130 for a Ctrl-C (one line on stderr).
What differs is what 0 and 1 mean, listed here per command by its words under `pdmctl`.
"""

from __future__ import annotations

BAD_INPUT = "bad input (a mistyped option or value, an unknown name, an unreadable store)"
INTERRUPTED = "interrupted (Ctrl-C)"
WAIT_INTERRUPTED = "Ctrl-C while waiting: the runs go on, and the line says how to follow them"

EXIT_CODES: dict[str, list[tuple[int, str]]] = {
    "sweep": [(0, "submitted (or, with --dry-run, planned); with --wait: every run finished or was stopped "
                  "by its collapse rule"),
              (1, "with --wait: a run ended otherwise (failed, cancelled, timed out, lost)"),
              (2, BAD_INPUT), (130, WAIT_INTERRUPTED)],
    "status": [(0, "the runs were read, whatever their states: failed or cancelled runs exit 0 too (read "
                   "the state column, or --json's)"),
               (2, BAD_INPUT + "; --json with --watch"), (130, INTERRUPTED)],
    "resume": [(0, "resubmitted (or, with --dry-run, listed); with --wait: every run finished"),
               (1, "with --wait: a run ended otherwise"), (2, BAD_INPUT), (130, WAIT_INTERRUPTED)],
    "cancel": [(0, "cancelled, or nothing was queued or running to cancel"),
               (1, "not confirmed at the prompt: nothing cancelled"),
               (2, BAD_INPUT + "; no terminal on stdin to confirm on and no --yes: nothing cancelled"),
               (130, INTERRUPTED + "; at the prompt: nothing cancelled")],
    "logs": [(0, "printed (with --follow: until the run ended)"),
             (1, "with --follow: the log was removed or replaced while following"),
             (2, BAD_INPUT + "; no log yet (without --follow)"), (130, INTERRUPTED)],
    "doctor": [(0, "every check passed"), (2, "a check failed (the line names it), or " + BAD_INPUT),
               (130, INTERRUPTED)],
    "preflight": [(0, "every setting passed (or, without --wait, its runs were submitted; with --dry-run, "
                      "planned)"),
                  (2, "a setting failed (its line says why), or " + BAD_INPUT), (130, WAIT_INTERRUPTED)],
    "report": [(0, "the report was written"), (2, BAD_INPUT + "; no runs to report on"), (130, INTERRUPTED)],
    "seeds": [(0, "the look was printed (with --submit: its runs submitted)"),
              (2, BAD_INPUT + "; nothing to look at yet (no setting has all its runs ended)"), (130, INTERRUPTED)],
    "tune": [(0, "the study has its trials (on a cluster without --wait: this pass submitted what it could)"),
             (2, BAD_INPUT), (130, "Ctrl-C while driving the study: its trials in flight go on, and the same "
                                   "command again continues the study")],
    "server status": [(0, "the server and its database answer"), (1, "either is down"), (2, BAD_INPUT)],
    "server user add": [(0, "added"), (1, "no password was given at the prompt (end of input)"), (2, BAD_INPUT)],
}  # fmt: skip
DEFAULT = [(0, "done"), (2, BAD_INPUT), (130, INTERRUPTED)]


def codes(command: str) -> list[tuple[int, str]]:
    """The exit codes of the command `command` (its words under `pdmctl`: `server status`)."""
    return EXIT_CODES.get(command, DEFAULT)


def help_text(command: str) -> str:
    """The help's section: `Exit codes:` and one line per code."""
    return "Exit codes:\n" + "\n".join(f"{code:>3}  {meaning}" for code, meaning in codes(command)) + "\n\n"
