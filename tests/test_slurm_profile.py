"""The SLURM executor without a cluster: profile options, time formats, sacct/squeue parsing, arrays,
the dry-run script of the h20 profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdmctl.executors import ExecutorError, JobState, load_profile, make_executor
from pdmctl.executors.base import ClusterProfile
from pdmctl.executors.slurm import SlurmExecutor, SlurmOptions, expand_job_id, parse_job_states, parse_time


def _profile(tmp_path: Path, **options) -> ClusterProfile:
    return ClusterProfile(
        name="t", executor="slurm", workdir=str(tmp_path), max_concurrent=4, options=options
    )


@pytest.mark.parametrize(
    ("value", "minutes"),
    [(90, 90), ("90", 90), ("30:00", 30), ("30:01", 31), ("2:00:00", 120), ("1-00", 1440),
     ("1-02:30", 1590), ("2-00:00:00", 2880)],
)  # fmt: skip
def test_time_formats(value, minutes) -> None:
    assert parse_time(value) == minutes


@pytest.mark.parametrize("value", ["", "soon", "1:2:3:4", 0, -5, True, "0"])
def test_bad_time_is_one_line(value) -> None:
    with pytest.raises(ExecutorError, match=r"time: ") as info:
        parse_time(value, "cluster t")
    assert "\n" not in str(info.value)


def test_pending_ranges_expand() -> None:
    assert expand_job_id("12_[0-2,5%2]") == ["12_0", "12_1", "12_2", "12_5"]
    assert expand_job_id("12_7") == ["12_7"]
    assert expand_job_id("12") == ["12"]


def test_sacct_and_squeue_lines_map_to_states() -> None:
    text = "\n".join([
        "12_0|COMPLETED", "12_1|CANCELLED by 0", "12_2|TIMEOUT", "12_3|RUNNING", "12_[4-6%2]|PENDING",
        "13|OUT_OF_MEMORY", "14_0|NODE_FAIL", "14_1|PREEMPTED", "14_2|REQUEUED", "14_3|COMPLETING",
        "14_4|FAILED", "14_5|BOOT_FAIL", "14_6|SOMETHING_NEW",
    ])  # fmt: skip
    states = parse_job_states(text)
    assert states["12_0"] == JobState.COMPLETED
    assert states["12_1"] == JobState.CANCELLED
    assert states["12_2"] == JobState.TIMEOUT
    assert states["12_3"] == JobState.RUNNING
    assert [states[f"12_{i}"] for i in (4, 5, 6)] == [JobState.PENDING] * 3
    assert states["13"] == JobState.OUT_OF_MEMORY
    assert states["14_0"] == JobState.NODE_FAIL
    assert states["14_1"] == JobState.PREEMPTED
    assert states["14_2"] == JobState.REQUEUED
    assert states["14_3"] == JobState.RUNNING  # still cleaning up: not ended yet
    assert states["14_4"] == JobState.FAILED
    assert states["14_5"] == JobState.NODE_FAIL
    assert states["14_6"] == JobState.UNKNOWN


@pytest.mark.parametrize(
    ("options", "message"),
    [({"partiton": "x"}, "unknown option 'partiton'"), ({"nodes": 0}, "nodes: must be an integer >= 1"),
     ({"gpus_per_node": "8"}, "gpus_per_node: must be an integer"), ({"mem_gb": -1}, "mem_gb: must be"),
     ({"sbatch": "--exclusive"}, "sbatch: must be a list"), ({"sbatch": ["exclusive"]}, "is not a long option"),
     ({"setup": [1]}, "setup: must be a list of strings"), ({"time": "forever"}, "time: 'forever'"),
     ({"partition": ""}, "partition: must be a non-empty string")],
)  # fmt: skip
def test_bad_options_are_refused_in_one_line(tmp_path: Path, options, message) -> None:
    with pytest.raises(ExecutorError, match=message) as info:
        SlurmOptions.from_profile(_profile(tmp_path, **options))
    assert str(info.value).startswith("cluster t: ") and "\n" not in str(info.value)


def test_extra_sbatch_lines() -> None:
    opts = SlurmOptions(sbatch=("--constraint=h20", "#SBATCH --exclusive", "--comment run one"))
    assert opts.extra_sbatch() == {"constraint": "h20", "exclusive": True, "comment": "run one"}


def test_arrays_split_at_max_array_size_and_share_the_limit(tmp_path: Path, monkeypatch) -> None:
    executor = SlurmExecutor(_profile(tmp_path))
    monkeypatch.setattr(executor, "max_array_size", lambda: 400)
    arrays = executor._arrays(1000)
    assert [(a.start, a.stop) for a, _ in arrays] == [(0, 400), (400, 800), (800, 1000)]
    assert [p for _, p in arrays] == [2, 1, 1]  # 4 shared out, at least 1 each
    assert [p for _, p in executor._arrays(3)] == [3]  # never more than the array has


def test_h20_profile_dry_run_script() -> None:
    profile = load_profile("h20")
    assert profile.tracking_uri and profile.tracking_uri.startswith("http")
    executor = make_executor(profile)
    text = executor.describe([None] * 12)
    for line in ("#SBATCH --nodes=4", "#SBATCH --gres=gpu:8", "#SBATCH --array=0-11%4", "#SBATCH --requeue",
                 "#SBATCH --time=2880", "#SBATCH --exclusive", "#SBATCH --signal=B:USR2@300",
                 "#SBATCH --partition=CHANGE-ME-partition", "#SBATCH --account=CHANGE-ME-account",
                 "#SBATCH --qos=CHANGE-ME-qos", "exec python -u -m submitit.core._submit"):  # fmt: skip
        assert line in text, line


def test_slurm_local_profile_loads() -> None:
    executor = make_executor(load_profile("slurm-local"))
    assert isinstance(executor, SlurmExecutor)
    assert executor.options.partition == "debug"


def test_the_gpu_check_profile_asks_for_one_real_gpu_and_tells_the_trainer() -> None:
    """scripts/gpu-check.sh's SLURM job (issue 18, item 12): one node, gres gpu:1 (SLURM sets
    CUDA_VISIBLE_DEVICES), and the trainer's n_gpus_per_node through the profile's env."""
    profile = load_profile("slurm-local-gpu")
    executor = make_executor(profile)
    assert isinstance(executor, SlurmExecutor) and executor.nodes_per_job() == 1
    text = executor.describe([None])
    assert "#SBATCH --gres=gpu:1" in text and "#SBATCH --nodes=1" in text, text
    assert "PDMCTL_GPUS_PER_NODE=1" in text, text


# --- a profile against its schema (issue 20, item 15) -----------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [("workdir: 5", r"^cluster p: workdir: must be a string or null, got 5$"),
     ("tracking_uri: 7", r"^cluster p: tracking_uri: must be a string or null, got 7$"),
     ("max_concurrent: true", r"max_concurrent: must be an integer or null, got True"),
     ("name: [a]", r"name: must be a string, got \['a'\]"),
     ("workdir: ~nosuchuser/x", r"^cluster p: workdir: '~nosuchuser/x': "),
     ("max_concurent: 1", r"^cluster p: unknown key 'max_concurent' for the local executor"),
     ("executor: slurm\nmax_concurent: 1", r"^cluster p: unknown option 'max_concurent' for the slurm executor"),
     ("executor: slurm\nnodes: four", r"^cluster p: nodes: must be an integer >= 1, got 'four'$")],
)  # fmt: skip
def test_a_profile_is_validated_against_its_schema(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ExecutorError, match=message) as info:
        load_profile(str(path))
    assert "\n" not in str(info.value)


def test_a_bad_profile_is_one_line_and_exit_2_at_the_cli(tmp_path: Path) -> None:
    from tests.conftest import pdmctl

    for name, content in (("typo.yaml", b"max_concurent: 1\n"), ("latin1.yaml", "name: caf\xe9\n".encode("latin-1")),
                          ("home.yaml", b"workdir: ~nosuchuser/x\n")):  # fmt: skip
        (tmp_path / name).write_bytes(content)
        result = pdmctl("sweep", "--dry-run", "--cluster", str(tmp_path / name), cwd=tmp_path)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, (name, result.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home.yaml", "latin1.yaml", "typo.yaml"]
