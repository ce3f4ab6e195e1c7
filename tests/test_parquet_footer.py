"""The parquet footer reader of the login node (no pyarrow there): the row count and top-level columns
pyarrow reads, on the layouts pyarrow writes; a damaged or hostile footer is a ParquetError and nothing
else; and the commands that need what pdmctl's core install leaves out say which extra brings it."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pdmctl.backends.verl.parquet_footer import ParquetError, read_footer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

TABLES = {
    "flat": lambda: pa.table({"prompt": ["a", "b"], "data_source": ["x", "y"], "n": [1, 2]}),
    "nested": lambda: pa.table(
        {
            "prompt": [[{"role": "user", "content": "hi"}]],
            "reward_model": [{"ground_truth": "1", "style": "rule"}],
            "extra_info": [{"index": 3, "split": "train", "deep": {"a": [1.0, 2.0]}}],
            "flag": [True],
            "map": pa.array([[("k", 1)]], type=pa.map_(pa.string(), pa.int64())),
        }
    ),
    "empty": lambda: pa.table(
        {"prompt": pa.array([], pa.string()), "data_source": pa.array([], pa.string())}
    ),
    "row groups": lambda: pa.table({"x": list(range(20_000)), "s": [str(i) for i in range(20_000)]}),
    "unicode": lambda: pa.table({"prömpt ✓": [1]}),
}
OPTIONS = [{}, {"row_group_size": 1000}, {"compression": "zstd", "use_dictionary": False}, {"version": "1.0"},
           {"data_page_version": "2.0"}]  # fmt: skip


@pytest.mark.parametrize("name", list(TABLES))
def test_rows_and_columns_are_pyarrows(tmp_path: Path, name: str) -> None:
    path = tmp_path / "t.parquet"
    for options in OPTIONS:
        pq.write_table(TABLES[name](), path, **options)
        footer = read_footer(path)
        meta = pq.ParquetFile(path)
        assert footer.num_rows == meta.metadata.num_rows, options
        assert list(footer.names) == meta.schema_arrow.names, options


@pytest.mark.parametrize(
    ("data", "message"),
    [(b"", "0 bytes, too short"), (b"prompt,data_source\n1,2\n", "no PAR1 magic"),
     (b"PAR1 not really parquet PAR1", "a footer of"), (b"PAR1" + bytes(4) + (4).to_bytes(4, "little") + b"PAR1",
      "no row count or no schema"), (b"PAR1" + bytes(8) + b"PARE", "encrypted")],
)  # fmt: skip
def test_what_is_not_parquet_is_said_in_one_line(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "x.parquet"
    path.write_bytes(data)
    with pytest.raises(ParquetError, match=message):
        read_footer(path)


def test_a_damaged_footer_is_a_parquet_error_or_an_answer_never_a_crash(tmp_path: Path) -> None:
    source = tmp_path / "t.parquet"
    pq.write_table(TABLES["nested"](), source)
    raw = source.read_bytes()
    length = int.from_bytes(raw[-8:-4], "little")
    rng = random.Random(0)
    damaged = tmp_path / "damaged.parquet"
    for _ in range(500):
        data = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(raw) - 8 - length, len(raw) - 8)] = rng.randrange(256)
        damaged.write_bytes(bytes(data))
        with contextlib.suppress(ParquetError):  # an answer is fine too: a byte of a name or a count changed
            read_footer(damaged)


def test_a_hostile_footer_is_refused_before_it_allocates_or_recurses(tmp_path: Path) -> None:
    def file(footer: bytes) -> Path:
        path = tmp_path / "hostile.parquet"
        path.write_bytes(b"PAR1" + footer + len(footer).to_bytes(4, "little") + b"PAR1")
        return path

    with pytest.raises(ParquetError, match="nests more than"):
        read_footer(file(b"\x1c" * 10_000))  # field 1, a struct, inside itself
    with pytest.raises(ParquetError, match="lists"):
        read_footer(file(b"\x19\xfc\xff\xff\xff\x0f"))  # field 1, a list of 4 billion structs
    with pytest.raises(ParquetError, match="ends early"):
        read_footer(file(b"\x18\xff\xff\xff\x7f"))  # field 1, a string of 256 MiB


# the CLI with some modules not importable, as where pdmctl's core install leaves them out
WITHOUT = """
import runpy, sys
blocked = sys.argv[1].split(",")
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Blocked())
sys.argv = ["pdmctl", *sys.argv[2:]]
runpy.run_module("pdmctl.cli", run_name="__main__")
"""


def without(modules: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return subprocess.run([sys.executable, "-c", WITHOUT, modules, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**env, "COLUMNS": "200"})  # fmt: skip


def test_without_pyarrow_data_prepare_names_it_and_writes_nothing(tmp_path: Path) -> None:
    result = without("pyarrow", "data", "prepare", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "pip install pyarrow" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_without_flask_sharing_a_sweep_names_the_server_extra(tmp_path: Path) -> None:
    result = without(
        "flask", "server", "share", "s", "bob", "--tracking-uri", "http://127.0.0.1:9", cwd=tmp_path
    )
    assert result.returncode != 0
    assert "pip install 'pdmctl[server]'" in result.stderr + result.stdout, result.stderr
