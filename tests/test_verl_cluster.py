"""A VeRL run against its cluster profile, without a cluster: node counts, offline weights and data,
checkpoint retention, network settings, the head's address and ports, what --dry-run shows,
every command, every run and the cost."""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import struct
from collections.abc import Collection
from pathlib import Path

import pytest
import yaml

from pdmctl.backends.verl import jobbody, launch, offline
from pdmctl.backends.verl.quoting import quoted
from pdmctl.executors import ExecutorError, load_profile, make_executor
from pdmctl.grid import expand
from pdmctl.orchestrate import Context, check_runs
from tests.conftest import pdmctl, stage_model

BASE = {"checkpoint_dir": "/ckpt", "data_dir": "/data"}


def _profile_file(tmp_path: Path, **fields) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "executor": "slurm", "workdir": str(tmp_path / "runs"), **fields}))
    return path


def _check(specs, profile_path: str) -> None:
    profile = load_profile(profile_path)
    check_runs(specs, Context(profile, "sqlite:///x.db"), make_executor(profile))


# --- nnodes from the allocation -------------------------------------------------------------


STAGED_PRESETS = {"Qwen3-4B-Base": "qwen3-4b-base", "Qwen3-8B-Base": "qwen3-8b-base",
                  "Qwen3-30B-A3B-Base": "qwen3-30b-a3b-base"}  # fmt: skip


def _staged(tmp_path: Path, *models: str) -> tuple[Path, Path]:
    """A models directory with a complete copy of each model (a config naming its architecture, a
    tokenizer, weights of its preset's size: `stage_model`; another name is staged as the 4B) and the data."""
    from pdmctl.backends.verl.data import _write_parquet, to_verl_rows

    models_dir, data_dir = tmp_path / "models", tmp_path / "data"
    for name in models:
        stage_model(models_dir / name, STAGED_PRESETS.get(name, "qwen3-4b-base"))
    data_dir.mkdir()
    rows = to_verl_rows([{"problem": "1+1", "answer": "2"}], "aime24", "test")
    for file in (launch.TRAIN_FILE, *launch.VAL_FILES):
        _write_parquet(rows, data_dir / file)
    return models_dir, data_dir


def _h20(tmp_path: Path, **changes) -> str:
    """clusters/h20.yaml with the CHANGE-ME paths pointed at `tmp_path`."""
    fields = {**yaml.safe_load((Path(__file__).parents[1] / "clusters" / "h20.yaml").read_text()), **changes}
    path = tmp_path / "h20.yaml"
    path.write_text(yaml.safe_dump(fields))
    return str(path)


def test_the_4b_and_8b_presets_train_on_the_h20_profiles_four_nodes(tmp_path: Path) -> None:
    assert launch.MODEL_PRESETS["qwen3-4b-base"].nnodes == launch.MODEL_PRESETS["qwen3-8b-base"].nnodes == 4
    assert load_profile("h20").options["nodes"] == 4
    models, data = _staged(tmp_path, "Qwen3-4B-Base", "Qwen3-8B-Base", "Qwen3-30B-A3B-Base")
    specs = expand(["backend=verl", "model=qwen3-4b-base,qwen3-8b-base,qwen3-30b-a3b-base"], None, "s")
    _check(specs, _h20(tmp_path, models_dir=str(models), data_dir=str(data)))


def test_inside_the_job_the_trainer_spans_the_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    run = {**BASE, "model": "qwen3-4b-base"}
    monkeypatch.delenv("SLURM_NNODES", raising=False)
    monkeypatch.delenv("SLURM_JOB_NUM_NODES", raising=False)
    assert "trainer.nnodes=4" in jobbody.build_job_command(run)
    monkeypatch.setenv("SLURM_NNODES", "2")
    command = jobbody.build_job_command(run)
    assert "trainer.nnodes=2" in command and "trainer.nnodes=4" not in command


def test_a_run_on_more_nodes_than_a_job_of_the_profile_is_refused_and_fewer_are_taken(tmp_path: Path) -> None:
    """A 4-node preset on a profile of 2-node jobs is refused in one line; on 2 or on 1 node
    (backend.nnodes) it is taken: a run of fewer nodes than the profile's packs beside others."""
    specs = expand(["backend=verl", "model=qwen3-4b-base"], None, "s")
    with pytest.raises(ExecutorError, match=r"trains on 4 node\(s\) but cluster t gives at most 2 per job") as info:
        _check(specs, str(_profile_file(tmp_path, nodes=2, offline=False)))
    assert "\n" not in str(info.value)
    for nodes in (2, 1):
        fewer = expand(["backend=verl", "model=qwen3-4b-base", f"backend.nnodes={nodes}"], None, "s")
        _check(fewer, str(_profile_file(tmp_path, nodes=2, offline=False)))


def test_a_toy_run_takes_any_allocation(tmp_path: Path) -> None:
    # one process on the job's first node: a 2-node profile holds both (the CI's node-loss test)
    toy = expand(["backend=toy", "seed=0,1"], None, "s")
    _check(toy, str(_profile_file(tmp_path, nodes=2, offline=False)))


def test_the_cli_refuses_a_node_mismatch_in_one_line_and_writes_nothing(workdir: Path) -> None:
    result = pdmctl("sweep", "backend=verl", "model=qwen3-4b-base", "--dry-run", cwd=workdir)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "trains on 4 node(s) but cluster local gives at most 1 per job" in lines[0]
    assert not (workdir / "mlflow.db").exists()
    ok = pdmctl("sweep", "backend=verl", "model=qwen3-4b-base", "backend.nnodes=1", "--dry-run", cwd=workdir)
    assert ok.returncode == 0, ok.stderr


# --- offline by default on a cluster --------------------------------------------------------


@pytest.mark.parametrize(
    ("broken", "message"),
    [("no models_dir", r"is offline \(HF_HUB_OFFLINE=1\) and 'Qwen/Qwen3-4B-Base' is not a local directory"),
     ("no copy", r"models/Qwen3-4B-Base is not a directory"),
     ("no tokenizer", r"lacks a tokenizer"), ("no weights", r"lacks weights"), ("no config", r"lacks config.json"),
     ("no aime25", r"data/aime25.parquet does not exist")],
)  # fmt: skip
def test_weights_and_data_missing_from_shared_storage_are_refused_at_submit(tmp_path: Path, broken, message) -> None:
    models, data = _staged(tmp_path, "Qwen3-4B-Base")
    copy = models / "Qwen3-4B-Base"
    fields = {"models_dir": str(models), "data_dir": str(data)}
    if broken == "no models_dir":
        del fields["models_dir"]
    elif broken == "no copy":
        for f in copy.iterdir():
            f.unlink()
        copy.rmdir()
    elif broken == "no tokenizer":
        (copy / "tokenizer.json").unlink()
    elif broken == "no weights":
        (copy / "model.safetensors").unlink()
    elif broken == "no config":
        (copy / "config.json").unlink()
    else:
        (data / "aime25.parquet").unlink()
    specs = expand(["backend=verl", "model=qwen3-4b-base"], None, "s")
    with pytest.raises(ExecutorError, match=message) as info:
        _check(specs, _h20(tmp_path, **fields) if "models_dir" in fields else _h20(tmp_path, models_dir=None,
                                                                                   data_dir=str(data)))  # fmt: skip
    assert "\n" not in str(info.value)


def test_a_runs_own_model_path_and_data_dir_are_checked_too(tmp_path: Path) -> None:
    models, data = _staged(tmp_path, "mine")
    own = [f"backend.model_path={models / 'mine'}", f"backend.data_dir={data}"]
    _check(expand(["backend=verl", "model=qwen3-4b-base", *own], None, "s"), _h20(tmp_path, models_dir=None, data_dir=None))
    with pytest.raises(ExecutorError, match="lacks weights"):
        (models / "mine" / "model.safetensors").unlink()
        _check(expand(["backend=verl", "model=qwen3-4b-base", *own], None, "s"), _h20(tmp_path))


def test_the_offline_jobs_environment_and_where_the_job_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    executor = make_executor(load_profile(_h20(tmp_path, models_dir="/shared/models", data_dir="/shared/data")))
    setup = executor.sbatch_parameters(1)["setup"]
    assert "export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1" in setup
    assert "export PDMCTL_MODELS_DIR=/shared/models" in setup and "export PDMCTL_DATA_DIR=/shared/data" in setup
    online = make_executor(load_profile(_h20(tmp_path, offline=False)))
    assert not any("OFFLINE" in line for line in online.sbatch_parameters(1)["setup"])
    # inside the job: the profile's directories, exported by that setup
    from pdmctl.backends.registry import _verl_job_config

    monkeypatch.setenv("PDMCTL_MODELS_DIR", "/shared/models")
    monkeypatch.setenv("PDMCTL_DATA_DIR", "/shared/data")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = _verl_job_config({"model": "qwen3-4b-base"}, tmp_path)
    assert cfg["data_dir"] == "/shared/data"
    overrides = launch.verl_overrides(cfg)
    assert f"actor_rollout_ref.model.path={quoted('/shared/models/Qwen3-4B-Base')}" in overrides
    assert f"data.train_files={quoted(Path('/shared/data/dapo_math_17k.parquet'))}" in overrides
    assert launch.job_env(cfg)["HF_HUB_OFFLINE"] == "1"  # and on to every Ray worker


@pytest.mark.parametrize(
    ("fields", "message"),
    [({"offline": "yes"}, "offline: must be true or false"), ({"models_dir": "models"}, "models_dir: must be an absolute path"),
     ({"env": ["A=1"]}, "env: must be a mapping"), ({"env": {"1A": "x"}}, "env: '1A' is not a variable name"),
     ({"env": {"A": True}}, "env: A: must be a string or a number"), ({"nccl_timeout": 0}, "nccl_timeout: must be an integer >= 1"),
     ({"network_interface": "ib 0"}, "network_interface: must be the name of a network interface"),
     ({"network_interface": "a-name-too-long-for-linux"}, "network_interface: must be the name"),
     ({"network_interface": ["ib0"]}, "network_interface: must be the name"),
     ({"engine_stall_s": "1h"}, "engine_stall_s: must be an integer >= 1")],
)  # fmt: skip
def test_bad_cluster_fields_are_one_line(tmp_path: Path, fields, message) -> None:
    with pytest.raises(ExecutorError, match=message) as info:
        make_executor(load_profile(str(_profile_file(tmp_path, **fields))))
    assert "\n" not in str(info.value)


# --- checkpoint retention -------------------------------------------------------------------


def test_verl_keeps_three_checkpoints_unless_the_run_says() -> None:
    assert "trainer.max_actor_ckpt_to_keep=3" in launch.verl_overrides({**BASE, "model": "qwen3-4b-base"})
    five = launch.verl_overrides({**BASE, "model": "qwen3-4b-base", "max_ckpt_to_keep": 5})
    assert "trainer.max_actor_ckpt_to_keep=5" in five
    with pytest.raises(launch.LaunchConfigError, match="max_ckpt_to_keep: must be a whole number >= 1"):
        launch.verl_overrides({**BASE, "model": "qwen3-4b-base", "max_ckpt_to_keep": 0})


# --- network settings -----------------------------------------------------------------------


def test_the_profiles_env_block_reaches_every_job_after_its_setup(tmp_path: Path) -> None:
    profile = _profile_file(tmp_path, env={"NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_GID_INDEX": 3},
                            setup=["source /env/bin/activate"])  # fmt: skip
    setup = make_executor(load_profile(str(profile))).sbatch_parameters(1)["setup"]
    assert set(setup[-2:]) == {"export NCCL_SOCKET_IFNAME=ib0", "export NCCL_IB_GID_INDEX=3"}
    assert setup.index("source /env/bin/activate") < setup.index("export NCCL_SOCKET_IFNAME=ib0")


def test_the_profiles_network_interface_reaches_the_job_body(tmp_path: Path) -> None:
    """`network_interface: ib0` is exported as PDMCTL_RAY_INTERFACE, which the job body
    resolves on every node (jobbody.JOB_BODY); without it nothing is exported."""
    setup = make_executor(load_profile(str(_profile_file(tmp_path, network_interface="ib0")))).sbatch_parameters(1)["setup"]
    assert "export PDMCTL_RAY_INTERFACE=ib0" in setup
    plain = make_executor(load_profile(str(_profile_file(tmp_path)))).sbatch_parameters(1)["setup"]
    assert not any("PDMCTL_RAY_INTERFACE" in line for line in plain)


def test_the_profiles_engine_stall_s_is_the_jobs_stall_limit(tmp_path: Path) -> None:
    exports = make_executor(load_profile(str(_profile_file(tmp_path, engine_stall_s=5400)))).job_exports()
    assert "export PDMCTL_ENGINE_STALL_S=5400" in exports  # jobbody.stall_seconds reads it over the preset's


def test_nccl_timeout_is_1800_across_nodes_and_the_profiles_where_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDMCTL_NCCL_TIMEOUT", raising=False)
    run = {**BASE, "model": "qwen3-4b-base"}
    assert "actor_rollout_ref.nccl_timeout=1800" in launch.verl_overrides(run, nnodes=4)
    assert not any(o.startswith("actor_rollout_ref.nccl_timeout=") for o in launch.verl_overrides(run, nnodes=1))
    monkeypatch.setenv("PDMCTL_NCCL_TIMEOUT", "900")
    assert "actor_rollout_ref.nccl_timeout=900" in launch.verl_overrides(run, nnodes=1)


# --- what --dry-run shows (and checkpoint sizes) ------------------------------------------------


def test_dry_run_prints_every_distinct_command_its_runs_a_verl_key_and_the_checkpoints(workdir: Path) -> None:
    result = pdmctl("sweep", "backend=verl", "model=qwen3-4b-base", "backend.nnodes=1", "k=10,20",
                    "backend.max_ckpt_to_keep=2", "verl.actor_rollout_ref.rollout.gpu_memory_utilization=0.85",
                    "--dry-run", cwd=workdir)  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "VeRL jobs: 2 run(s), 1 setting(s), 2 distinct command(s)" in out
    assert "command 1.1 (" in out and "python -m pdmctl.backends.verl.jobbody train" in out
    for override in ("+actor_rollout_ref.actor.policy_loss.topk=10", "trainer.max_actor_ckpt_to_keep=2",
                     "trainer.nnodes=1", "actor_rollout_ref.model.path=", "data.seed=SEED",
                     "actor_rollout_ref.rollout.gpu_memory_utilization=0.85"):  # fmt: skip
        assert override in out, override
    differs = next(line for line in out.splitlines() if line.startswith("  command 1.2 differs from 1.1 in: "))
    assert "+actor_rollout_ref.actor.policy_loss.topk=20" in differs and "model.path" not in differs
    runs = [line for line in out.splitlines() if line.startswith("    runs: ")]
    keys = re.findall(r"│ \d+\s+│ ([0-9a-f]{12}) │", out)  # the plan's table
    assert len(runs) == len(keys) == 2 and all(sum(key in line for line in runs) == 1 for key in keys)
    assert "cost: not estimated: the cluster profile states no throughput for qwen3-4b-base" in out  # local
    sizes = next(line for line in out.splitlines() if line.startswith("  checkpoints: "))
    assert "56.3 GB each" in sizes and "2 kept" in sizes and "112.6 GB a run" in sizes  # Megatron: 14 bytes
    assert "225.3 GB for the setting" in sizes
    assert sorted(p.name for p in workdir.iterdir()) == []  # a dry run writes nothing


def _parquet(data_dir: Path, train_rows: int) -> None:
    """The train file with `train_rows` rows and AIME 2024 / 2025 with 30 each (the dry run reads the counts)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, rows in ((launch.TRAIN_FILE, train_rows), (launch.VAL_FILES[0], 30), (launch.VAL_FILES[1], 30)):
        pq.write_table(pa.table({"row": list(range(rows))}), data_dir / name)


def test_the_paper_sweeps_dry_run_shows_every_command_every_run_and_the_cost(tmp_path: Path) -> None:
    """paper-main on the h20 profile: 48 runs, 4 settings first in the array, 16 distinct commands each
    shown (the 30B Megatron FP8 one whole), every run under its command, GPU-hours and wall time per run,
    setting and sweep from batch x n x response length and the profile's throughput, the storage."""
    from pdmctl.backends.verl.describe import Throughput
    from pdmctl.budget import cost
    from pdmctl.grid import load_sweep_file
    from pdmctl.orchestrate import describe_runs, plan

    models, data = _staged(tmp_path, "Qwen3-4B-Base", "Qwen3-8B-Base", "Qwen3-30B-A3B-Base")
    _parquet(data, train_rows=17_408)
    profile = load_profile(_h20(tmp_path, models_dir=str(models), data_dir=str(data)))
    ctx = Context(profile, f"sqlite:///{tmp_path / 'none.db'}")
    ordered = plan(expand([], load_sweep_file("paper-main")), ctx, order="seed").to_submit
    assert len(ordered) == 48
    settings = [(s.config["model"]["name"], s.config["precision"]["name"]) for s in ordered]
    assert settings[:4] == [("qwen3-4b-base", "bf16"), ("qwen3-8b-base", "bf16"),
                            ("qwen3-30b-a3b-base", "fp8_e2e"), ("qwen3-30b-a3b-base", "fp8_rollout")]  # fmt: skip
    lines = describe_runs(ordered, ctx, make_executor(profile))
    text = "\n".join(lines)
    assert lines[0].startswith("VeRL jobs: 48 run(s), 4 setting(s), 16 distinct command(s)")
    assert sum(line.startswith("  command ") for line in lines) == 16
    listed = " ".join(line for line in lines if line.startswith("    runs: "))
    assert all(listed.count(spec.key) == 1 for spec in ordered)
    megatron = text[text.index("  command 3.1 ("):text.index("  command 3.2 ")]
    assert "model_engine=megatron" in megatron and "override_transformer_config.fp8=hybrid" in megatron
    assert "actor_rollout_ref.actor.megatron.expert_model_parallel_size=8" in megatron

    rates = {m: Throughput(**r) for m, r in yaml.safe_load((Path(__file__).parents[1] / "clusters" / "h20.yaml")
                                                          .read_text())["throughput"].items()}  # fmt: skip
    total_hours, run_seconds = 0.0, []
    for model, batch, n, response in (("qwen3-4b-base", 128, 8, 8192), ("qwen3-8b-base", 128, 8, 8192),
                                      ("qwen3-30b-a3b-base", 256, 16, 16384), ("qwen3-30b-a3b-base", 256, 16, 16384)):  # fmt: skip
        steps, rate, gpus = launch.PAPER_STEPS, rates[model], 32  # fixed, not the data's (DAPO's 300)
        validations = 1 + steps // 10 + (steps % 10 > 0)  # before training, every 10 steps, the last
        tokens, held_out = batch * n * response, 60 * 16 * response
        dear = cost.ASSUMPTIONS[model]  # the rates and the fixed time a step at their dear end
        rollout, train = rate.rollout * dear.rollout_rate.high * gpus, rate.train * dear.train_rate.high * gpus
        seconds = (steps * (tokens / rollout + tokens / train + dear.step_fixed_s.high)
                   + validations * held_out / rollout)  # fmt: skip
        assert f"{steps} steps of {tokens / 1e6:.2f} M tokens generated and trained, {validations} validations" in text
        total_hours += 12 * seconds * gpus / 3600
        run_seconds += [seconds] * 12
    # at the length cap: every response at the cap, every rate and the fixed time at their dear end, plus start-ups
    # and checkpoint writes at their dear end
    at_cap = [12 * seconds * gpus / 3600 for seconds in run_seconds[::12]]
    uppers = [float(line.split("at the length cap ")[1].split(" (")[0].replace(",", ""))
              for line in lines if line.startswith("  setting cost: 12 run(s), ")]  # fmt: skip
    assert len(uppers) == 4 and all(cap <= upper <= 1.1 * cap for cap, upper in zip(at_cap, uppers, strict=True))
    sweep = lines[-1]
    upper = float(sweep.split("at the length cap ")[1].split(" (")[0].replace(",", ""))
    assert sweep.startswith("sweep cost: 48 run(s), ") and total_hours <= upper <= 1.1 * total_hours, sweep
    days = float(sweep.split("; at the length cap ")[1].split(" days")[0])
    assert sum(run_seconds) / 4 <= days * 86400 * 1.001 and days * 86400 <= 1.1 * (sum(run_seconds) / 4 + max(run_seconds))
    assert "at max_concurrent 4 (4 x 4 node(s) at a time)" in sweep
    # 12 runs x 3 kept per setting; every setting on Megatron: 14 bytes a parameter
    kept = sum(12 * 3 * launch.MODEL_PRESETS[m].parameters * 14 for m in
               ("qwen3-4b-base", "qwen3-8b-base", "qwen3-30b-a3b-base", "qwen3-30b-a3b-base"))  # fmt: skip
    assert f"checkpoints: {kept / 1e12:.2f} TB at most" in sweep
    megatron_sizes = next(line for line in text[text.index("setting 3/4"):].splitlines() if line.startswith("  checkpoints: "))
    assert "30.53 B parameters x 14 bytes, Megatron distributed: bf16 weights 2" in megatron_sizes, megatron_sizes
    assert "x 12 bytes, FSDP" not in text
    # each command says its training engine, its attention and its ratio cap: Megatron everywhere, no
    # flash-attn, PDM and DPPO uncapped (the paper's loss), GRPO clip-higher at DAPO's 10
    said = [line for line in lines if line.startswith("    settings: ")]
    assert len(said) == 16
    assert all(line.startswith("    settings: training engine megatron (Megatron-LM); attention fused (Transformer "
                               "Engine, Megatron), sdpa (the model's HF config), vLLM's own in the rollout; ratio cap ")
               for line in said), said  # fmt: skip
    assert sorted(line.rsplit("ratio cap ", 1)[1] for line in said) == ["10.0"] * 4 + ["none"] * 12


def test_a_sweep_of_one_setting_keeps_its_grid_order() -> None:
    from pdmctl.orchestrate import settings_first

    specs = expand(["seed=0,1,2", "k=10,20"], None, "s")
    assert settings_first(specs) == specs
    mixed = expand(["precision=bf16,fp8_rollout", "seed=0,1"], None, "s")  # grid order: bf16 0, 1, fp8 0, 1
    assert [s.config["precision"]["name"] for s in settings_first(mixed)] == ["bf16", "fp8_rollout", "bf16", "fp8_rollout"]


def test_checkpoints_kept_are_the_saves_where_a_run_saves_fewer() -> None:
    size, kept, saves = launch.checkpoint_bytes({**BASE, "model": "qwen3-tiny", "total_training_steps": 2})
    assert (kept, saves) == (2, 2) and size == 353_000 * 12
    size, kept, saves = launch.checkpoint_bytes({**BASE, "model": "qwen3-8b-base"})
    assert (kept, saves) == (3, 30) and size == 8_190_735_360 * 14  # 300 steps, a save every 10; Megatron
    assert launch.checkpoint_bytes({**BASE, "model": "qwen3-tiny-gpu", "total_training_steps": None})[1:] == (3, 3)


# --- whole files, not names -----------------------------------------------------------------


def _shard_index(copy: Path) -> None:
    (copy / "model.safetensors").rename(copy / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _parquet_without(data: Path, column: str | None) -> None:
    import pyarrow.parquet as pq

    table = pq.read_table(data / "aime24.parquet")
    pq.write_table(table.drop_columns([column]) if column else table.slice(0, 0), data / "aime24.parquet")


def _tensor_data(weights: Path) -> tuple[int, int]:
    """Where a safetensors file's tensor data lies in it: (its first byte, the byte after its last)."""
    with open(weights, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    return 8 + length, 8 + length + max(entry["data_offsets"][1] for entry in header.values())


def _sparse_weights(weights: Path, written: Collection[int] = (), zeros: bool = False) -> None:
    """The weights' header kept and its declared size, the data gone: a hole but at the `written`
    sampled regions (random bytes there, or zero bytes), as an interrupted or pre-allocated download leaves it."""
    start, end = _tensor_data(weights)
    os.truncate(weights, start)
    os.truncate(weights, end)
    with open(weights, "r+b") as fh:
        for i, (first, last) in enumerate(offline.sampled_regions(start, end)):
            if i in written:
                os.pwrite(fh.fileno(), bytes(last - first) if zeros else os.urandom(last - first), first)


def _zero_weights(weights: Path, parameters: int = 2_000_000) -> None:
    """A safetensors file of `parameters` bf16 zeros, every byte written (4 MB)."""
    header = json.dumps({"model.weight": {"dtype": "BF16", "shape": [parameters], "data_offsets": [0, 2 * parameters]}})
    weights.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(2 * parameters))


@pytest.mark.parametrize(
    ("damage", "message"),
    [("empty config", "config.json is empty (0 bytes)"), ("config not JSON", "config.json cannot be read as JSON"),
     ("empty tokenizer", "tokenizer.json is empty"), ("empty weights", "model.safetensors is empty"),
     ("weights a directory", "model.safetensors is not a file"),
     ("weights cut short", "model.safetensors is cut short: its tensors need"),
     ("weights not safetensors", "model.safetensors is not a safetensors file"),
     ("a shard missing", "names model-00002-of-00002.safetensors, which is not there"),
     ("empty parquet", "aime24.parquet is empty (0 bytes)"), ("not parquet", "aime24.parquet is not a parquet file"),
     ("no prompt column", "aime24.parquet lacks the column(s) VeRL reads: prompt"),
     ("no rows", "aime24.parquet has no rows"),
     ("stand-in config", "config.json names no architectures, not Qwen3ForCausalLM: these are not the preset's weights"),
     ("another architecture", "config.json names ['Qwen3MoeForCausalLM'], not Qwen3ForCausalLM"),
     ("stand-in weights", "the weights hold 4 parameters, the preset's model 4,022,468,096: not the preset's weights"),
     ("the 8B's weights", "the weights hold 8,190,735,360 parameters, the preset's model 4,022,468,096"),
     ("weights sparse", "model.safetensors is sparse: no data on disk at byte "),
     ("weights sparse at one place", "model.safetensors is sparse: no data on disk at byte 4290630451 of its tensors"),
     ("weights zero-filled", "model.safetensors holds only zero bytes in its tensors at the 16 places sampled"),
     ("weights zeros where sampled", "model.safetensors holds only zero bytes in its tensors at the 16 places")],
)  # fmt: skip
def test_empty_or_partial_weights_and_data_are_refused_at_submit(tmp_path: Path, damage: str, message: str) -> None:
    models, data = _staged(tmp_path, "Qwen3-4B-Base")
    copy = models / "Qwen3-4B-Base"
    weights = copy / "model.safetensors"
    change = {
        "empty config": lambda: (copy / "config.json").write_bytes(b""),
        "config not JSON": lambda: (copy / "config.json").write_text("{not json"),
        "empty tokenizer": lambda: (copy / "tokenizer.json").write_bytes(b""),
        "empty weights": lambda: weights.write_bytes(b""),
        "weights a directory": lambda: (weights.unlink(), weights.mkdir()),
        "weights cut short": lambda: os.truncate(weights, weights.stat().st_size - 4),
        "weights not safetensors": lambda: weights.write_text("{}"),
        "a shard missing": lambda: _shard_index(copy),
        "empty parquet": lambda: (data / "aime24.parquet").write_bytes(b""),
        "not parquet": lambda: (data / "aime24.parquet").write_text("prompt,data_source\n1,2\n"),
        "no prompt column": lambda: _parquet_without(data, "prompt"),
        "no rows": lambda: _parquet_without(data, None),
        "stand-in config": lambda: (copy / "config.json").write_text("{}"),
        "another architecture": lambda: (copy / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"]}'),
        "stand-in weights": lambda: stage_model(copy, "qwen3-4b-base", parameters=4),
        "the 8B's weights": lambda: stage_model(copy, "qwen3-4b-base", parameters=8_190_735_360),
        "weights sparse": lambda: _sparse_weights(weights),
        "weights sparse at one place": lambda: _sparse_weights(weights, written=set(range(16)) - {8}),
        "weights zero-filled": lambda: _zero_weights(weights),
        "weights zeros where sampled": lambda: _sparse_weights(weights, written=range(16), zeros=True),
    }
    specs = expand(["backend=verl", "model=qwen3-4b-base"], None, "s")
    profile = _h20(tmp_path, models_dir=str(models), data_dir=str(data))
    _check(specs, profile)  # the staged copy itself is whole
    change[damage]()
    with pytest.raises(ExecutorError, match=re.escape(message)) as info:
        _check(specs, profile)
    assert "\n" not in str(info.value)


def test_the_weights_check_samples_16_regions_from_the_first_byte_of_the_tensors_to_the_last() -> None:
    regions = offline.sampled_regions(1000, 1000 + 60 * 2**30)
    assert len(regions) == 16 and all(end - start == 4096 for start, end in regions)
    assert regions[0][0] == 1000 and regions[-1][1] == 1000 + 60 * 2**30
    gaps = {b[0] - a[0] for a, b in itertools.pairwise(regions)}
    assert max(gaps) - min(gaps) <= 1  # evenly spaced
    assert offline.sampled_regions(100, 110) == [(100, 110)]  # data shorter than a region: all of it
    assert offline.sampled_regions(100, 100) == []


def _tiny_qwen3(tmp_path: Path) -> Path:
    """The tiny Qwen3 as CI builds it ($PDMCTL_TINY_DIR, else the checkout's .cache/qwen3-tiny); built
    here when that is not (yet) built."""
    from pdmctl.backends.verl import tiny

    built = Path(os.environ.get(launch.TINY_DIR_ENV) or Path(__file__).parents[1] / ".cache" / "qwen3-tiny")
    return (built if tiny.is_built(built) else tiny.ensure(tmp_path / "tiny")) / "model"


def _random_safetensors(tmp_path: Path) -> Path:
    """A model directory whose weights the safetensors library wrote: random tensors of three dtypes."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    model = tmp_path / "random"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    (model / "tokenizer.json").write_text("{}")
    save_file({"embed": rng.standard_normal((1000, 256)).astype(np.float16), "norm": np.ones(256, np.float32),
               "proj": rng.standard_normal((256, 512)).astype(np.float32)}, str(model / "model.safetensors"))
    return model


def test_where_the_filesystem_does_not_say_where_its_holes_are_a_mostly_sparse_shard_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without SEEK_DATA (EINVAL) the blocks on disk count: a file with under half its bytes there is refused."""
    def no_seek_data(fd: int, pos: int, how: int) -> int:
        if how == getattr(os, "SEEK_DATA", None):
            raise OSError(errno.EINVAL, "Invalid argument")
        return seek(fd, pos, how)

    seek = os.lseek
    whole, sparse = _random_safetensors(tmp_path), stage_model(tmp_path / "sparse", "qwen3-4b-base")
    monkeypatch.setattr(os, "lseek", no_seek_data)
    offline.check_model_dir(whole, "random")
    with pytest.raises(offline.OfflineFilesError, match=r"model.safetensors is sparse: \d+ of its 8044936\d+ bytes are on disk"):
        offline.check_model_dir(sparse, "qwen3-4b-base")


@pytest.mark.parametrize("weights", ["written by the safetensors library", "the tiny Qwen3 as CI builds it"])
def test_downloaded_or_built_weights_pass_the_check_of_their_data(tmp_path: Path, weights: str) -> None:
    """Weights written whole (no hole, not zeros) pass the sampling check of their tensor data: a file the
    safetensors library writes of random tensors, and the tiny Qwen3 transformers saves."""
    if weights == "the tiny Qwen3 as CI builds it":
        offline.check_model_dir(_tiny_qwen3(tmp_path), "qwen3-tiny")
    else:
        offline.check_model_dir(_random_safetensors(tmp_path), "random", offline.ModelShape("Qwen3ForCausalLM", 387_328))
