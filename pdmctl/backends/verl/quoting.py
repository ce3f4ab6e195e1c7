"""Values into Hydra overrides that Hydra reads back exactly.

A VeRL job's overrides pass through Hydra's override grammar and then
OmegaConf's interpolation, both on the allocation after the queue wait. A raw
`data.train_files=/d/a,b/x.parquet` is a sweep over two values there, and `'`,
`]`, `${` make an override unparsable or resolve to something else. Every
free-form value (paths, names, URIs) therefore goes through `quoted()`, and
`check_overrides()` parses the whole list with Hydra's own parser at submit
time, so what cannot pass fails at `pdmctl sweep`.
"""

from __future__ import annotations

import re

_ESCAPED = re.compile(r"(\\*)('|\$\{|$)")


def quoted(value: object) -> str:
    """`value` as a single-quoted Hydra string whose parsed and resolved value is `str(value)`.

    Hydra keeps backslashes literal except in a run before a quote or the end of
    the string, where they are doubled; OmegaConf reads `\\${` as a literal `${`.
    """

    def escape(match: re.Match[str]) -> str:
        backslashes, what = match.group(1), match.group(2)
        if what == "'":
            return backslashes * 2 + "\\'"
        if what == "${":
            return backslashes * 2 + "\\${"
        return backslashes * 2  # the end of the string

    return "'" + _ESCAPED.sub(escape, str(value)) + "'"


class OverrideError(ValueError):
    """An override that Hydra cannot parse."""


def check_overrides(overrides: list[str]) -> None:
    """Parse every override with Hydra's own parser (what the job will do); raise OverrideError on the first bad one."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parsed = parser.parse_override(override)
        except HydraException as err:
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise OverrideError(
                f"VeRL override {override!r} cannot be parsed by Hydra: {first_line}"
            ) from None
        if parsed.is_sweep_override():  # main_ppo is not a multirun: `a,b` would be a sweep there
            raise OverrideError(f"VeRL override {override!r} reads as a sweep over several values in Hydra")
        if parsed.value() == "???":  # OmegaConf's MISSING, whatever the quoting: the job would stop on it
            raise OverrideError(f"VeRL override {override!r} reads as OmegaConf's missing value '???' in VeRL's "
                                "config: give it another value")  # fmt: skip
