"""The SLURM executor without a cluster: profile options, time formats, sacct/squeue parsing, arrays,
the dry-run script of the h20 profile, runs at once against a partition, placeholders, a failing setup."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from pdmctl.executors import ExecutorError, JobState, load_profile, make_executor
from pdmctl.executors.base import CLUSTER_DIR, ClusterProfile
from pdmctl.executors.slurm import (
    SlurmExecutor,
    SlurmOptions,
    expand_job_id,
    parse_job_states,
    parse_partitions,
    parse_time,
)


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
    arrays = executor._arrays([(1, 1000)])
    assert [(a.start, a.stop) for _, a, _ in arrays] == [(0, 400), (400, 800), (800, 1000)]
    assert [p for _, _, p in arrays] == [2, 1, 1]  # 4 shared out, at least 1 each
    assert [p for _, _, p in executor._arrays([(1, 3)])] == [3]  # never more than the array has


def test_runs_of_fewer_nodes_than_the_profile_pack_side_by_side_in_their_own_array(tmp_path: Path) -> None:
    """A profile of 4-node jobs at max_concurrent 4: runs of 1 node go in an array of their own (--nodes=1)
    whose %-limit packs 4 of them into each 4-node share; where both counts come in one submission, each
    array may fill every share (the partition holds them together). The dry run's description says so."""
    executor = SlurmExecutor(_profile(tmp_path, nodes=4))
    assert executor._groups([1, None, 1, 4]) == [(1, [0, 2]), (4, [1, 3])]
    assert [(n, p) for n, _, p in executor._arrays([(1, 20)])] == [(1, 16)]  # 4 shares x 4 runs of 1 node
    assert [(n, p) for n, _, p in executor._arrays([(2, 20)])] == [(2, 8)]
    assert [(n, p) for n, _, p in executor._arrays([(4, 20), (1, 20)])] == [(4, 4), (1, 16)]
    assert executor.sbatch_parameters(8, 1)["nodes"] == 1 and executor.sbatch_parameters(2)["nodes"] == 4
    text = executor.describe([None] * 6, [1, 1, 1, 1, 4, 4])
    assert "6 job(s) as 2 SLURM job array(s)" in text
    assert "sbatch --array=0-3%4 --nodes=1  (4 run(s) of 1 node(s), 4 side by side in each of max_concurrent's shares)" in text
    assert "sbatch --array=0-1%2 --nodes=4  (2 run(s) of 4 node(s))" in text
    assert "#SBATCH --nodes=1" in text  # the first array's script


def test_h20_profile_dry_run_script() -> None:
    profile = load_profile("h20")
    assert profile.tracking_uri and profile.tracking_uri.startswith("http")
    executor = make_executor(profile)
    text = executor.describe([None] * 12)
    for line in ("#SBATCH --nodes=4", "#SBATCH --gres=gpu:8", "#SBATCH --array=0-11%4", "#SBATCH --requeue",
                 "#SBATCH --time=2880", "#SBATCH --exclusive", "#SBATCH --signal=B:USR2@2700",
                 "#SBATCH --partition=CHANGE-ME-partition", "#SBATCH --account=CHANGE-ME-account",
                 "#SBATCH --qos=CHANGE-ME-qos", "exec python -u -m submitit.core._submit",
                 "PDMCTL_SAVE_GRACE_S=2400"):  # fmt: skip
        assert line in text, line


def test_slurm_local_profile_loads() -> None:
    executor = make_executor(load_profile("slurm-local"))
    assert isinstance(executor, SlurmExecutor)
    assert executor.options.partition == "debug"


def test_the_gpu_check_profile_asks_for_one_real_gpu_and_tells_the_trainer() -> None:
    """scripts/gpu-check.sh's SLURM job: one node, gres gpu:1 (SLURM sets
    CUDA_VISIBLE_DEVICES), and the trainer's n_gpus_per_node through the profile's env."""
    profile = load_profile("slurm-local-gpu")
    executor = make_executor(profile)
    assert isinstance(executor, SlurmExecutor) and executor.nodes_per_job() == 1
    text = executor.describe([None])
    assert "#SBATCH --gres=gpu:1" in text and "#SBATCH --nodes=1" in text, text
    assert "PDMCTL_GPUS_PER_NODE=1" in text, text


# --- a profile against its schema -----------------------------------------------------------


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


# --- checked at once: runs against the partition, placeholders, a setup that fails ---------------


def _h20_profile(tmp_path: Path, **changes) -> ClusterProfile:
    """clusters/h20.yaml as loaded, with its partition named and `changes` applied."""
    h20 = load_profile("h20")
    options = {**h20.options, "partition": "gpu", **changes}
    return ClusterProfile(name="h20", executor="slurm", workdir=str(tmp_path),
                          max_concurrent=options.pop("max_concurrent", h20.max_concurrent), options=options)  # fmt: skip


def _h20_partition(nodes: int) -> str:
    """`sinfo -h -o SINFO_FORMAT` of an H20 partition of `nodes` nodes (the shape an H20 site prints)."""
    return f"gpu*|up|2-00:00:00|{nodes}|192|2000000|gpu:8(S:0-1)\n"


def test_max_concurrent_times_nodes_is_checked_against_the_partition(tmp_path: Path) -> None:
    executor = make_executor(_h20_profile(tmp_path))  # max_concurrent 4, nodes 4, --exclusive
    with pytest.raises(ExecutorError) as info:
        executor.check_partitions(parse_partitions(_h20_partition(4)))
    assert str(info.value) == ("cluster h20: partition gpu has 4 node(s) and a job takes 4 node(s), each whole "
                               "(--exclusive): max_concurrent 4 x nodes 4 cannot run at once; at most 1 can "
                               "(set max_concurrent: 1)")  # fmt: skip
    executor.check_partitions(parse_partitions(_h20_partition(16)))
    make_executor(_h20_profile(tmp_path, max_concurrent=1)).check_partitions(parse_partitions(_h20_partition(4)))
    with pytest.raises(ExecutorError, match=r"at most 3 can \(set max_concurrent: 3\)"):
        make_executor(_h20_profile(tmp_path, sbatch=[], nodes=2)).check_partitions(  # --mem=0 gone too: shared
            parse_partitions("gpu*|up|infinite|6|192|2000000|gpu:8\n"))  # 8 GPUs a job: one to a node


def test_jobs_that_share_a_node_are_counted_by_what_each_takes(tmp_path: Path) -> None:
    """Without --exclusive or --mem=0, a 64-CPU, 8-GPU node holds min(64/16, 8/2, 1000/100) = 4 jobs."""
    partition = parse_partitions("debug*|up|infinite|1|64|1024000|gpu:8\n")
    shared = {"partition": "debug", "cpus_per_task": 16, "gpus_per_node": 2, "mem_gb": 100}
    SlurmExecutor(_profile(tmp_path, **shared)).check_partitions(partition)  # max_concurrent 4
    five = ClusterProfile(name="t", executor="slurm", workdir=str(tmp_path), max_concurrent=5, options=shared)
    with pytest.raises(ExecutorError, match=r"4 job\(s\) to a node by its CPUs: max_concurrent 5 x nodes 1 "):
        SlurmExecutor(five).check_partitions(partition)


def test_a_placeholder_left_in_the_profile_is_refused_in_one_line(tmp_path: Path) -> None:
    from pdmctl.executors.base import check_placeholders

    with pytest.raises(ExecutorError) as info:
        check_placeholders(load_profile("h20"))  # as shipped: CHANGE-ME everywhere
    message = str(info.value)
    assert message.startswith("cluster h20: tracking_uri still holds the placeholder 'CHANGE-ME' "
                              "('http://CHANGE-ME-mlflow-host:5000'); also in workdir, ")  # fmt: skip
    for field in ("partition", "account", "qos", "setup[0]", "setup[1]", "models_dir", "data_dir",
                  "network.NCCL_SOCKET_IFNAME", "network.GLOO_SOCKET_IFNAME", "network_interface"):  # fmt: skip
        assert field in message, field
    assert "\n" not in message
    filled = {"tracking_uri": "http://mlflow:5000", "workdir": "/shared/runs", "partition": "gpu", "account": "a",
              "qos": "q", "setup": ["source /shared/env/bin/activate"], "models_dir": "/shared/models",
              "data_dir": "/shared/data", "network": {"NCCL_SOCKET_IFNAME": "ib0"}, "network_interface": "ib0"}  # fmt: skip
    for where, value, left in (("setup", ["module load <your-cuda-module>"], "setup[0]"),
                               ("network", {"NCCL_SOCKET_IFNAME": "change_me"}, "network.NCCL_SOCKET_IFNAME"),
                               ("qos", "TODO", "qos")):  # fmt: skip
        path = tmp_path / f"{where}.yaml"
        path.write_text(yaml.safe_dump({**yaml.safe_load(Path(CLUSTER_DIR / "h20.yaml").read_text()), **filled,
                                        where: value}))  # fmt: skip
        with pytest.raises(ExecutorError, match=rf"^cluster h20: {re.escape(left)} still holds the placeholder"):
            check_placeholders(load_profile(str(path)))
    path.write_text(yaml.safe_dump({**yaml.safe_load(Path(CLUSTER_DIR / "h20.yaml").read_text()), **filled}))
    check_placeholders(load_profile(str(path)))


def test_the_paper_sweep_on_the_shipped_h20_profile_is_refused_at_the_cli(tmp_path: Path) -> None:
    """Submitting on the profile as shipped is refused in one line before anything is written; planning it
    is not: the dry run prints its plan and cost with the placeholders named in one line."""
    from tests.conftest import pdmctl

    result = pdmctl("sweep", "--file", "paper-main", "--cluster", "h20", cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: cluster h20: tracking_uri still holds the placeholder 'CHANGE-ME'")
    plan = pdmctl("sweep", "--file", "paper-main", "--cluster", "h20", "--dry-run", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    first = plan.stdout.splitlines()[0]
    assert first.startswith("plan only: cluster h20: tracking_uri still holds the placeholder 'CHANGE-ME'"), first
    assert "sweep cost: 48 run(s), " in plan.stdout and "GPU-hours expected" in plan.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_laptop_without_slurm_plans_paper_main_with_its_cost(tmp_path: Path) -> None:
    """With no SLURM command on PATH (a laptop), the README's dry run plans paper-main on a filled-in profile:
    exit 0, one line saying what was not checked, every run's cost; the shared storage is not looked for."""
    from tests.conftest import pdmctl

    profile = tmp_path / "h20.yaml"
    profile.write_text((CLUSTER_DIR / "h20.yaml").read_text().replace("CHANGE-ME", "site"))
    empty = tmp_path / "bin"
    empty.mkdir()
    plan = pdmctl("sweep", "--file", "paper-main", "--cluster", str(profile), "--dry-run", cwd=tmp_path,
                  env={"PATH": str(empty)})  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    assert plan.stdout.splitlines()[0] == (
        "cluster h20: not checked against SLURM (no sinfo here): its partition site-partition and 4 node(s) a job "
        "are taken as the profile states them; the weights and data on its storage are not looked for")  # fmt: skip
    assert "sweep cost: 48 run(s), 63,325 GPU-hours expected" in plan.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "h20.yaml"]


def test_a_failing_setup_line_ends_the_job_there_and_is_named(tmp_path: Path) -> None:
    """The sbatch script the dry run prints, run by bash (the interpreter replaced by echo): a setup line
    that fails ends it before the job starts, with the line in its output; none is wrapped in `|| true`."""
    assert not any("|| true" in line for line in load_profile("h20").options["setup"])

    def run_script(setup: list[str]) -> subprocess.CompletedProcess:
        text = SlurmExecutor(_profile(tmp_path, setup=setup, python="/bin/echo")).describe([None])
        script = "\n".join(line[2:] for line in text.split("sbatch script of the first array:\n", 1)[1].splitlines())
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)

    ok = run_script(["export PDMCTL_SETUP_A=1", "echo set-up-$PDMCTL_SETUP_A"])
    assert ok.returncode == 0 and "set-up-1" in ok.stdout and "-u -m submitit.core._submit" in ok.stdout, ok
    failed = run_script(["echo before", "ls /nonexistent-pdmctl-module", "echo after"])
    assert failed.returncode != 0 and "before" in failed.stdout, failed
    assert "after" not in failed.stdout and "submitit" not in failed.stdout
    assert "RuntimeError: a setup line of the cluster profile failed (exit 2): ls /nonexistent-pdmctl-module" in failed.stderr


@pytest.mark.parametrize(
    "value", [{"qwen3-4b-base": {"rollout": 3000}}, {"qwen3-4b-base": {"rollout": 0, "train": 1}}, [1, 2],
              {"qwen3-4b-base": {"rollout": "fast", "train": 1}}],
)  # fmt: skip
def test_a_bad_throughput_is_one_line(tmp_path: Path, value) -> None:
    with pytest.raises(ExecutorError, match=r"^cluster t: throughput: ") as info:
        SlurmOptions.from_profile(_profile(tmp_path, throughput=value))
    assert "\n" not in str(info.value)
