"""The CPU engine's pieces that run without the engine environment: job environment, overrides, hygiene."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pdmctl.backends.verl import cpu, launch, metrics, tiny
from tests.test_verl_launch import BASE

pytestmark = pytest.mark.verl


def test_job_env_keeps_the_external_modules_the_driver_had(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", "site.platform,pdmctl.backends.verl.plugin")
    env = launch.job_env({**BASE, "model": "qwen3-tiny"})
    # the CPU platform first (VeRL resolves the platform while the plugin imports), nothing dropped or doubled
    assert env["VERL_USE_EXTERNAL_MODULES"] == f"{cpu.MODULE},{launch.PLUGIN_MODULE},site.platform"
    forwarded = launch.ray_env_overrides(env)
    assert (
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES='{env['VERL_USE_EXTERNAL_MODULES']}'"
        in forwarded
    )
    assert env["VERL_PLATFORM"] == "cpu"


def test_gpu_presets_get_no_cpu_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VERL_USE_EXTERNAL_MODULES", raising=False)
    env = launch.job_env({**BASE, "model": "qwen3-4b-base"})
    assert env["VERL_USE_EXTERNAL_MODULES"] == launch.PLUGIN_MODULE
    assert "VERL_PLATFORM" not in env
    assert not any(
        o.startswith("trainer.device=") for o in launch.verl_overrides({**BASE, "model": "qwen3-4b-base"})
    )


def test_a_local_model_path_replaces_the_preset_weights() -> None:
    overrides = launch.verl_overrides({**BASE, "model": "qwen3-4b-base", "model_path": "/models/my-4b"})
    assert "actor_rollout_ref.model.path='/models/my-4b'" in overrides  # quoted: Hydra reads it back exactly
    assert launch.compose(overrides).actor_rollout_ref.model.path == "/models/my-4b"


def test_tiny_preset_composes_with_cpu_settings_and_its_cache_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(launch.TINY_DIR_ENV, "/cache/tiny")
    config = launch.compose(launch.verl_overrides({**BASE, "model": "qwen3-tiny"}))
    assert config.actor_rollout_ref.model.path == "/cache/tiny/model"
    assert config.trainer.device == "cpu" and config.trainer.n_gpus_per_node == 1
    assert config.trainer.total_training_steps == 3
    assert config.actor_rollout_ref.rollout.max_model_len == 48  # prompt 32 + response 16


def test_tiny_splits_are_disjoint_and_named_for_the_report() -> None:
    splits = {name: {q for q, _ in tiny.problems(name)} for name in ("train", "aime24", "aime25")}
    assert not (splits["train"] & splits["aime24"]) and not (splits["train"] & splits["aime25"])
    assert not (splits["aime24"] & splits["aime25"])
    assert {row["data_source"] for row in tiny.verl_rows("aime24", "aime24")} == {"aime24"}
    assert metrics.pdmctl_metric_name("val-core/aime24/acc/mean_at_16") == "eval/aime24"


def test_tiny_tokenizer_has_what_verls_qwen_agent_loop_requires() -> None:
    # VeRL 0.9.1's QwenContinuousTokenBuilder (every agent-loop rollout of a Qwen3) requires
    # <|im_end|> and a one-token newline; without them the first rollout fails (seen on CPU)
    pytest.importorskip("tokenizers")
    tokenizer = tiny._train_tokenizer(tiny.TinyRecipe())
    for token in (tiny.EOS, *tiny.CHATML):
        assert isinstance(tokenizer.convert_tokens_to_ids(token), int)
    assert len(tokenizer.encode("\n", add_special_tokens=False)) == 1


def test_cleanup_ends_the_tagged_processes_and_their_segments_only(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    started = time.time()
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    tagged = subprocess.Popen(sleeper, env={**os.environ, cpu.ENGINE_TAG_ENV: tag})
    untagged = subprocess.Popen(sleeper)
    segment = Path("/dev/shm") / f"psm_pdmctl_test_{tag}"
    segment.write_bytes(b"x")
    try:
        deadline = time.monotonic() + 30
        while tagged.pid not in cpu.tagged_processes(tag) and time.monotonic() < deadline:
            time.sleep(0.1)  # the child's environ is readable once it has exec'd
        ended, removed = cpu.cleanup(tag, started, grace_s=5)
        assert ended == 1 and tagged.wait(timeout=10) is not None
        assert untagged.poll() is None, "a process of another job was ended"
        assert segment.name in removed and not segment.exists()
    finally:
        for proc in (tagged, untagged):
            proc.kill()
            proc.wait()
        segment.unlink(missing_ok=True)


def test_the_cleanup_command_a_job_runs_on_its_other_nodes_ends_the_tagged_processes() -> None:
    """`python -m pdmctl.backends.verl.cpu cleanup TAG SINCE` (the job body's step on every node but the
    first, without the tag itself): the tagged process ends, one line says so."""
    tag = uuid.uuid4().hex
    since = str(time.time())
    tagged = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                              env={**os.environ, cpu.ENGINE_TAG_ENV: tag})  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while tagged.pid not in cpu.tagged_processes(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        out = subprocess.run([sys.executable, "-m", cpu.MODULE, "cleanup", tag, since], capture_output=True,
                             text=True, timeout=60, check=True).stdout  # fmt: skip
        assert tagged.wait(timeout=10) is not None
        assert "pdmctl: ended 1 leftover engine process(es) on " in out, out
    finally:
        tagged.kill()
        tagged.wait()


def test_the_next_job_ends_what_a_killed_job_left_and_nothing_else(tmp_path: Path) -> None:
    """kill -9 runs no cleanup: the next engine job ends the processes whose owning job is gone, and
    none of a job whose tag was made in another PID namespace."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    owner = subprocess.Popen([sys.executable, "-c", "from pdmctl.backends.verl import cpu; print(cpu.new_tag())"],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    dead = owner.communicate(timeout=60)[0].strip()  # its owner has exited: as after kill -9
    live = cpu.new_tag()  # this process: a live job
    orphan = subprocess.Popen(sleeper, env={**os.environ, cpu.ENGINE_TAG_ENV: dead})
    mine = subprocess.Popen(sleeper, env={**os.environ, cpu.ENGINE_TAG_ENV: live})
    foreign = subprocess.Popen(sleeper, env={**os.environ, cpu.ENGINE_TAG_ENV: "not-a-pdmctl-tag"})
    # a job in another PID namespace (a node of the CI's 2-node cluster, a container): its owner's pid and
    # start time mean nothing here, so it is not judged dead, whatever this namespace's process of that pid is
    pid, ticks, namespace, rest = dead.split(".", 3)
    elsewhere = subprocess.Popen(sleeper, env={**os.environ, cpu.ENGINE_TAG_ENV: f"{pid}.{ticks}.{int(namespace) + 1}.{rest}"})
    bystander = subprocess.Popen(sleeper)
    segment = Path("/dev/shm") / f"verl_pdmctl_test_{uuid.uuid4().hex}"
    segment.write_bytes(b"x")
    try:
        assert not cpu.owner_alive(dead) and cpu.owner_alive(live)
        deadline = time.monotonic() + 30
        while orphan.pid not in cpu.tagged_processes(dead) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert orphan.pid in cpu.orphan_processes()
        ended, removed = cpu.cleanup_orphans(grace_s=5)
        assert orphan.wait(timeout=10) is not None
        assert ended >= 1
        for proc in (mine, foreign, elsewhere, bystander):
            assert proc.poll() is None, "ended a process whose job is alive"
        assert segment.name in removed and not segment.exists()
    finally:
        for proc in (orphan, mine, foreign, elsewhere, bystander):
            proc.kill()
            proc.wait()
        segment.unlink(missing_ok=True)
