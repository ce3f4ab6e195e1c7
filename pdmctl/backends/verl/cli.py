"""`pdmctl data prepare`: the typer sub-app the main CLI mounts as `data`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from pdmctl.backends.verl.data import (
    AIME24_SOURCE,
    AIME25_SOURCE,
    MANIFEST,
    TRAIN_SOURCE,
    DataFilter,
    DataSourceError,
    prepare_data,
    read_manifest,
)

app = typer.Typer(help="Datasets in VeRL's parquet layout.", no_args_is_help=True)


@app.callback()
def data() -> None:
    """Datasets in VeRL's parquet layout."""  # keeps `prepare` a sub-command when it is the only one


@app.command()
def prepare(
    out_dir: Annotated[Path, typer.Argument(help="Directory for the parquet files (the run's data_dir).")],
    train: Annotated[
        str, typer.Option(help="DAPO-Math-17k: a local .jsonl/.json/.parquet or a hub id.")
    ] = TRAIN_SOURCE,
    aime24: Annotated[str, typer.Option(help="AIME 2024: a local file or a hub id.")] = AIME24_SOURCE,
    aime25: Annotated[str, typer.Option(help="AIME 2025: a local file or a hub id.")] = AIME25_SOURCE,
    dedupe: Annotated[
        bool, typer.Option("--dedupe/--no-dedupe", help="Keep the first of each repeated prompt (every file).")
    ] = True,
    answer_format: Annotated[
        str, typer.Option(help="Training rows kept by their answer: any, or integer (a whole number, as AIME's).")
    ] = "any",
    max_prompt_chars: Annotated[
        int | None, typer.Option(help="Drop training rows whose templated prompt is longer (characters).")
    ] = None,
    max_prompt_tokens: Annotated[
        int | None, typer.Option(help="Drop training rows whose chat-templated prompt is longer (tokens of --tokenizer).")
    ] = None,
    tokenizer: Annotated[
        str | None, typer.Option(help="A local tokenizer directory that counts --max-prompt-tokens.")
    ] = None,
    ids: Annotated[
        Path | None, typer.Option(help="Keep only training rows with these source ids (one a line, or a JSON list).")
    ] = None,
) -> None:
    """Write dapo_math_17k.parquet, aime24.parquet, aime25.parquet and manifest.json (sources, filter, rows in
    and out, each output's SHA-256, and the digest a run carries) for VeRL."""
    console = Console()
    try:  # VeRL's environment has it; pdmctl's core install does not
        import pyarrow  # noqa: F401
    except ImportError:
        print(f"error: pdmctl data prepare reads and writes parquet with pyarrow, not installed in {sys.executable}: "
              "pip install pyarrow (and datasets, to read from the hub)", file=sys.stderr)  # fmt: skip
        raise typer.Exit(2) from None
    chosen = DataFilter(dedupe=dedupe, answer_format=answer_format, max_prompt_chars=max_prompt_chars,
                        max_prompt_tokens=max_prompt_tokens, tokenizer=tokenizer,
                        ids_file=None if ids is None else str(ids))
    try:
        written = prepare_data(out_dir.resolve(), train, aime24, aime25, chosen)
    except (DataSourceError, OSError) as err:
        print(f"error: {str(err).splitlines()[0] if str(err) else type(err).__name__}", file=sys.stderr)
        raise typer.Exit(2) from None
    table = Table("file", "data_source", "rows")
    for item in written:
        table.add_row(str(item.path), item.data_source, str(item.rows))
    console.print(table)
    manifest = read_manifest(out_dir.resolve(), verify=False)
    print(f"manifest: {out_dir.resolve() / MANIFEST}  digest {manifest['digest']}")
