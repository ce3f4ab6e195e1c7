"""Inside a VeRL job, a file under the run's checkpoint directory loads as weights only: what the
trainer writes there (model and optimizer shards as DTensors, the extra state with numpy's random
state, the dataloader's state, Megatron's torch.distributed.checkpoint metadata) loads as before, and a
planted pickle is refused in one line before any of it runs (pdmctl/backends/verl/safeload.py). Real
torch, a real gloo process group and torch.distributed.checkpoint; VeRL's own resume through the guard
is in tests/test_verl_engine.py's SLURM test."""

from __future__ import annotations

import functools
import importlib.util
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pdmctl.backends.verl import safeload


class Payload:
    """A pickle that makes a directory when it is loaded: the stand-in for code a planted file runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.makedirs, (str(self.marker),))


def _lr_lambda(step: int, warmup: int) -> float:
    return min(1.0, (step + 1) / warmup)


@pytest.fixture
def process_group(tmp_path: Path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_what_the_trainer_writes_loads_as_weights_only_and_unchanged(tmp_path: Path, process_group: None) -> None:
    """The FSDP2 engine's shards (DTensor weights, AdamW's state), the extra state (an LR scheduler's
    state, torch's, numpy's and Python's random states) and the dataloader's state, saved under the run's
    checkpoint directory, come back equal through the guarded torch.load."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    root = tmp_path / "checkpoints"
    actor = root / "global_step_1" / "actor"
    actor.mkdir(parents=True)
    mesh = init_device_mesh("cpu", (1,))
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(_lr_lambda, warmup=10))
    saved = {
        "model_world_size_1_rank_0.pt": {k: distribute_tensor(v.detach(), mesh, [Shard(0)])
                                         for k, v in model.state_dict().items()},  # fmt: skip
        "optim_world_size_1_rank_0.pt": optimizer.state_dict(),
        "extra_state_world_size_1_rank_0.pt": {
            "lr_scheduler": scheduler.state_dict(),
            "rng": {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()},
        },
    }
    for name, value in saved.items():
        torch.save(value, actor / name)
    data = {"_num_yielded": 3, "_sampler_iter_state": {"generator": torch.Generator().get_state(), "yielded": 12},
            "_index_sampler_state": None, "_iterator_finished": False}  # fmt: skip
    torch.save(data, root / "global_step_1" / "data.pt")

    load = safeload.guard(torch.load, root)
    model_state = load(str(actor / "model_world_size_1_rank_0.pt"))
    for key, value in saved["model_world_size_1_rank_0.pt"].items():
        assert type(model_state[key]).__name__ == "DTensor" and torch.equal(model_state[key].to_local(), value.to_local())
    optim = load(actor / "optim_world_size_1_rank_0.pt", map_location="cpu")
    assert optim["param_groups"] == saved["optim_world_size_1_rank_0.pt"]["param_groups"]
    for slot, state in saved["optim_world_size_1_rank_0.pt"]["state"].items():
        assert all(torch.equal(optim["state"][slot][k], v) for k, v in state.items())
    extra = load(actor / "extra_state_world_size_1_rank_0.pt", weights_only=False)  # VeRL's call, as it writes it
    assert extra["lr_scheduler"] == saved["extra_state_world_size_1_rank_0.pt"]["lr_scheduler"]
    numpy_state = extra["rng"]["numpy"]
    expected = saved["extra_state_world_size_1_rank_0.pt"]["rng"]["numpy"]
    assert numpy_state[0] == expected[0] and np.array_equal(numpy_state[1], expected[1]) and numpy_state[2:] == expected[2:]
    assert extra["rng"]["random"] == saved["extra_state_world_size_1_rank_0.pt"]["rng"]["random"]
    assert torch.equal(extra["rng"]["cpu"], saved["extra_state_world_size_1_rank_0.pt"]["rng"]["cpu"])
    loaded = load(str(root / "global_step_1" / "data.pt"), weights_only=False)
    assert loaded.keys() == data.keys() and torch.equal(loaded["_sampler_iter_state"]["generator"],
                                                        data["_sampler_iter_state"]["generator"])  # fmt: skip


@pytest.mark.parametrize("how", ["planted", "linked from elsewhere"])
def test_a_pickle_planted_in_the_checkpoint_directory_is_refused_and_never_runs(
    tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file in a step directory that names a function (here os.makedirs) is refused, naming the file
    and the function, as VeRL calls torch.load (weights_only=False); its code never runs. A link planted
    there is the same. A path outside the directory is left to torch.load as it was."""
    root = tmp_path / "checkpoints"
    target = root / "global_step_99999999" / "actor" / "model_world_size_1_rank_0.pt"
    target.parent.mkdir(parents=True)
    marker = tmp_path / "payload-ran"
    if how == "planted":
        torch.save({"weight": Payload(marker)}, target)
    else:
        elsewhere = tmp_path / "elsewhere.pt"
        torch.save({"weight": Payload(marker)}, elsewhere)
        target.symlink_to(elsewhere)
    load = safeload.guard(torch.load, root)
    with pytest.raises(safeload.RefusedCheckpoint) as refused:
        load(str(target), weights_only=False)
    message = str(refused.value)
    assert message.startswith(f"pdmctl: {target}: refused: it names os.makedirs") or message.startswith(
        f"pdmctl: {target}: refused: it names posix.makedirs"
    ), message
    assert "remove its step directory, then resume" in message and "\n" not in message
    assert capsys.readouterr().err.strip().splitlines()[-1] == message  # in the job's log too
    assert not marker.exists()
    # outside the run's checkpoint directory, torch.load is what it was (weights only by default in this torch)
    plain = tmp_path / "plain.pt"
    torch.save({"a": torch.ones(2)}, plain)
    assert torch.equal(load(plain)["a"], torch.ones(2))


def test_megatrons_checkpoint_metadata_loads_and_a_planted_one_is_refused(tmp_path: Path, monkeypatch) -> None:
    """torch.distributed.checkpoint's `.metadata` (Megatron's dist_ckpt format) under the run's checkpoint
    directory is read by the restricted unpickler: a checkpoint torch wrote loads whole; a metadata file
    that names a function is refused, and its code never runs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import filesystem

    root = tmp_path / "checkpoints"
    where = root / "global_step_2" / "actor" / "dist_ckpt"
    state = {"decoder.weight": torch.arange(12.0).reshape(3, 4), "step": torch.tensor(2)}
    dcp.save(state, checkpoint_id=str(where), no_dist=True)
    monkeypatch.setattr(filesystem.FileSystemReader, "read_metadata",
                        safeload.guard_metadata(filesystem.FileSystemReader.read_metadata, root))  # fmt: skip
    target = {"decoder.weight": torch.zeros(3, 4), "step": torch.tensor(0)}
    dcp.load(target, checkpoint_id=str(where), no_dist=True)
    assert torch.equal(target["decoder.weight"], state["decoder.weight"]) and int(target["step"]) == 2

    import pickle

    marker = tmp_path / "payload-ran"
    (where / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(safeload.RefusedCheckpoint, match=r"refused: it names (os|posix)\.makedirs"):
        filesystem.FileSystemReader(str(where)).read_metadata()
    assert not marker.exists()


MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


@pytest.mark.skipif(not MCORE, reason="needs megatron-core (the [verl] extra)")
def test_a_checkpoint_megatron_writes_loads_through_the_guards_and_a_planted_metadata_never_runs(
    tmp_path: Path,
) -> None:
    """Megatron-core's own dist_checkpointing (the format of VeRL's Megatron engine: common.pt by torch.load,
    `.metadata` by torch.distributed.checkpoint, with Megatron's planner) saved under the run's checkpoint
    directory loads through both guards unchanged; a `.metadata` replaced by a pickle that names a function
    is refused with pdmctl's line and never runs. In a process of its own (the guards patch torch there);
    Megatron's writer calls CUDA's synchronize and current device, made no-ops on this CPU."""
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(MEGATRON_PROBE)
    env = {**os.environ, safeload.DIR_ENV: str(tmp_path / "checkpoints"), "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "checkpoints")], capture_output=True,
                          text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "loaded: [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] {'iteration': 3}" in proc.stdout, proc.stdout
    refusal = f"pdmctl: {tmp_path / 'checkpoints' / 'global_step_1' / 'actor' / 'dist_ckpt' / '.metadata'}: refused: it names"
    assert refusal in proc.stderr, proc.stderr[-3000:]
    assert "planted: refused" in proc.stdout and not (tmp_path / "payload-ran").exists(), proc.stdout


MEGATRON_PROBE = '''
import os, pickle, sys
from pathlib import Path

import torch
import torch.distributed as dist


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def main(root):
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group("gloo", store=dist.FileStore(str(root.parent / "store"), 1), rank=0, world_size=1)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from pdmctl.backends.verl import safeload

    where = root / "global_step_1" / "actor" / "dist_ckpt"
    where.mkdir(parents=True)
    state = {"decoder.weight": ShardedTensor.from_rank_offsets("decoder.weight", torch.arange(6.0)),
             "extra": {"iteration": 3}}
    dist_checkpointing.save(state, str(where))
    safeload.install()
    safeload.install_dcp()
    template = {"decoder.weight": ShardedTensor.from_rank_offsets("decoder.weight", torch.zeros(6))}
    loaded = dist_checkpointing.load(template, str(where))
    print("loaded:", loaded["decoder.weight"].tolist(), loaded["extra"], flush=True)
    (where / ".metadata").write_bytes(pickle.dumps(Payload(str(root.parent / "payload-ran"))))
    try:
        dist_checkpointing.load(template, str(where))
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        print("planted: refused", type(exc).__name__, flush=True)
    else:
        print("planted: loaded", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
'''
