"""`pdmctl data prepare`: the typer sub-app the main CLI mounts as `data`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from pdmctl.backends.verl.data import (
    AIME24_SOURCE,
    AIME25_SOURCE,
    TRAIN_SOURCE,
    DataSourceError,
    prepare_data,
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
) -> None:
    """Write dapo_math_17k.parquet, aime24.parquet and aime25.parquet for VeRL."""
    console = Console()
    try:
        written = prepare_data(out_dir.resolve(), train, aime24, aime25)
    except DataSourceError as err:
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(1) from err
    table = Table("file", "data_source", "rows")
    for item in written:
        table.add_row(str(item.path), item.data_source, str(item.rows))
    console.print(table)
