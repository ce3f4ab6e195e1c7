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
import re
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


@pytest.mark.skipif(not MCORE, reason="needs megatron-core (the [verl] extra)")
def test_a_two_rank_megatron_checkpoint_as_verl_writes_it_loads_through_the_guards_equal_and_planted_rng_bytes_never_run(
    tmp_path: Path,
) -> None:
    """Megatron-core on two gloo ranks (data parallel 2) saves what VeRL's Megatron engine saves: a real
    megatron-core GPTModel's own `sharded_state_dict()` (its weights as ShardedTensors replicated across the
    ranks, each layer's `_extra_state` as a ShardedObject), a distributed optimizer's flat shares with its
    param groups, Transformer Engine's extra state per rank, and the RNG states with the RNG tracker's as a
    `ShardedObject` (stored as bytes inside the `.distcp` data, unpickled from a stream by torch's load
    planner). Through the guards it loads equal to the unguarded load, as saved. Bytes of the RNG object
    that hold a pickle naming a function run it when loaded unguarded (the control) and, through the guards,
    are refused with pdmctl's line on every rank and never run.

    The optimizer's part is laid out as DistributedOptimizer's sharded state lays out each rank's share, not
    written by one: megatron-core 0.16.1 builds no DistributedOptimizer on a CPU build of torch.
    `get_megatron_optimizer(OptimizerConfig(optimizer="adam", use_distributed_optimizer=True), [ddp])` (ddp a
    DistributedDataParallel of that GPTModel, which builds) raises in MixedPrecisionOptimizer.__init__, whose
    `torch.tensor([0], dtype=torch.int, device='cuda')` fails with "Torch not compiled with CUDA enabled"; with
    that tensor on the CPU (or bf16, which makes none), DistributedOptimizer._build_model_and_main_param_groups
    refuses every parameter whose `type()` is not a torch.cuda one ("TypeError: Wrapped parameters must be one
    of torch.cuda.FloatTensor, torch.cuda.HalfTensor, or torch.cuda.BFloat16Tensor. Received
    torch.FloatTensor"). A checkpoint the real optimizer writes loads through the guard on a GPU node."""
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(TWO_RANK_PROBE)
    env = {**os.environ, safeload.DIR_ENV: str(tmp_path / "checkpoints"), "PYTHONPATH": str(Path(__file__).parents[1])}
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path), str(rank)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]  # fmt: skip
    outputs = [proc.communicate(timeout=600) for proc in procs]
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, out[-3000:] + err[-3000:]
        for line in ("control ran: True", "guarded equal: True", "as saved: True True", "planted: refused",
                     "payload ran: False"):  # fmt: skip
            assert f"rank {rank}: {line}" in out, out + err[-3000:]
        # megatron-core's GPTModel: every weight back as saved, and its layers' extra state
        assert re.search(rf"rank {rank}: model as saved: True \d+ tensor\(s\), [1-9]\d* extra state\(s\)", out), out
        refusal = f"pdmctl: {tmp_path / 'checkpoints' / 'global_step_2' / 'actor' / 'dist_ckpt'} (an object stored in it): refused: it names"
        assert refusal in err, err[-3000:]
    assert not (tmp_path / "payload-ran").exists()


TWO_RANK_PROBE = '''"""Two ranks of megatron-core on gloo: a checkpoint laid out as VeRL's Megatron engine writes it, loaded
unguarded and through pdmctl's guards; then one whose RNG state's bytes hold a planted pickle."""
import os, random, sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker, 0o777, True))


def state(rank, model, planted=None):
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    torch.manual_seed(rank)
    random.seed(rank)
    np.random.seed(rank)
    from megatron.core import tensor_parallel

    # the RNG tracker's states (CUDA generators' on a GPU; the CPU generator's state here)
    tensor_parallel.get_cuda_rng_tracker().set_states({"model-parallel-rng": torch.get_rng_state(),
                                                       "expert-parallel-rng": torch.get_rng_state()})
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(),
           "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if planted is not None:
        rng["np_rng_state"] = Payload(planted)
    weight = torch.arange(12.0).reshape(3, 4) + 100 * rank
    return {
        "gpt": model.sharded_state_dict(),  # megatron-core's own: weights and each layer's extra state
        "model": {
            "decoder.layers.0.mlp.weight": ShardedTensor.from_rank_offsets("decoder.layers.0.mlp.weight", weight, (0, rank, 2)),
            # Transformer Engine's extra state: a tensor of bytes, one object per rank
            "decoder.layers.0.self_attention._extra_state": ShardedObject(
                "decoder.layers.0.self_attention._extra_state", torch.tensor([7, rank], dtype=torch.uint8), (2,), (rank,), replica_id=0),
        },
        # the distributed optimizer's state: each data-parallel rank's share of a flat buffer
        "optimizer": {
            "exp_avg": ShardedTensor.from_rank_offsets("optimizer.exp_avg", torch.full((6,), 0.5 + rank), (0, rank, 2)),
            "exp_avg_sq": ShardedTensor.from_rank_offsets("optimizer.exp_avg_sq", torch.full((6,), 0.25 * (rank + 1)), (0, rank, 2)),
            "param_groups": [{"lr": 1e-6, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "step": 3, "params": [0, 1]}],
        },
        # VeRL: one ShardedObject for the (pp, tp) rank, its data the RNG states of every data-parallel rank
        "rng_state": ShardedObject("rng_state", [rng, rng], (1, 1), (0, 0), replica_id=rank),
        "iteration": 3,
    }


def template(rank, model):
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return {
        "gpt": model.sharded_state_dict(),
        "model": {
            "decoder.layers.0.mlp.weight": ShardedTensor.from_rank_offsets("decoder.layers.0.mlp.weight", torch.zeros(3, 4), (0, rank, 2)),
            "decoder.layers.0.self_attention._extra_state": ShardedObject(
                "decoder.layers.0.self_attention._extra_state", None, (2,), (rank,), replica_id=0),
        },
        "optimizer": {
            "exp_avg": ShardedTensor.from_rank_offsets("optimizer.exp_avg", torch.zeros(6), (0, rank, 2)),
            "exp_avg_sq": ShardedTensor.from_rank_offsets("optimizer.exp_avg_sq", torch.zeros(6), (0, rank, 2)),
        },
        "rng_state": ShardedObject("rng_state", None, (1, 1), (0, 0), replica_id=rank),
    }


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def main(root, rank):
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group("gloo", store=dist.FileStore(str(root / "store"), 2), rank=rank, world_size=2)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from pdmctl.backends.verl import safeload

    parallel_state.initialize_model_parallel(1, 1)  # data parallel over the two ranks
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                               params_dtype=torch.float32)

    def gpt(seed):
        torch.manual_seed(seed)
        return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=32,
                        max_sequence_length=8)

    model, blank = gpt(0), gpt(1)  # the saved model (the same on both data-parallel ranks), the one loaded into

    good = root / "checkpoints" / "global_step_1" / "actor" / "dist_ckpt"
    planted = root / "checkpoints" / "global_step_2" / "actor" / "dist_ckpt"
    control = root / "elsewhere" / "dist_ckpt"
    for where in (good, planted, control):
        where.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state(rank, model), str(good))
    dist_checkpointing.save(state(rank, model, planted=str(root / "payload-ran")), str(planted))
    dist_checkpointing.save(state(rank, model, planted=str(root / "control-ran")), str(control))
    dist.barrier()
    unguarded = dist_checkpointing.load(template(rank, blank), str(good))
    dist_checkpointing.load(template(rank, blank), str(control))  # without the guards, the planted bytes run
    dist.barrier()
    print(f"rank {rank}: control ran: {(root / 'control-ran').exists()}", flush=True)
    safeload.install()
    safeload.install_dcp()
    guarded = dist_checkpointing.load(template(rank, blank), str(good))
    print(f"rank {rank}: guarded equal: {same(unguarded, guarded)}", flush=True)
    weights = {k: v.data for k, v in model.sharded_state_dict().items() if isinstance(v, ShardedTensor)}
    extra = sorted(k for k in guarded["gpt"] if k.endswith("._extra_state"))
    print(f"rank {rank}: model as saved: {same(weights, {k: guarded['gpt'][k] for k in weights})} "
          f"{len(weights)} tensor(s), {len(extra)} extra state(s)", flush=True)
    # one RNG object for the (pp, tp) rank, written by data-parallel replica 0: every rank reads rank 0's
    print(f"rank {rank}: as saved: {same(guarded['rng_state'], state(0, model)['rng_state'].data)} "
          f"{same(guarded['optimizer']['param_groups'], state(rank, model)['optimizer']['param_groups'])}", flush=True)
    try:
        dist_checkpointing.load(template(rank, blank), str(planted))
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        print(f"rank {rank}: planted: refused {type(exc).__name__}", flush=True)
    else:
        print(f"rank {rank}: planted: loaded", flush=True)
    print(f"rank {rank}: payload ran: {(root / 'payload-ran').exists()}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
'''


# --- every pickle opcode that calls, planted in every format the guards read -----------------------------


def touch(path: str) -> None:
    """The side effect a planted call would have: a file appears."""
    Path(path).touch()


class TouchOnNew:
    """A class whose construction (`__new__`, as NEWOBJ and NEWOBJ_EX call it) has the side effect."""

    def __new__(cls, path: str = "", *args: object, **kwargs: object) -> TouchOnNew:
        touch(path)
        return super().__new__(cls)


class TouchOnSetState:
    """A class whose `__setstate__` (as BUILD calls it) has the side effect."""

    def __setstate__(self, path: str) -> None:
        touch(path)


def _planted(opcode: str, module: str, name: str, arg: str) -> bytes:
    """A pickle whose only work is `opcode` calling `module.name` with `arg`."""
    m, n = module.encode(), name.encode()
    a = b"X" + len(arg.encode()).to_bytes(4, "little") + arg.encode()  # BINUNICODE, which torch's reader takes
    return {
        "REDUCE": b"c" + m + b"\n" + n + b"\n(" + a + b"tR.",
        "INST": b"(" + a + b"i" + m + b"\n" + n + b"\n.",
        "OBJ": b"(c" + m + b"\n" + n + b"\n" + a + b"o.",
        "NEWOBJ": b"\x80\x02c" + m + b"\n" + n + b"\n" + a + b"\x85\x81.",
        "NEWOBJ_EX": b"\x80\x04c" + m + b"\n" + n + b"\n" + a + b"\x85}\x92.",
        "BUILD": b"\x80\x02c" + m + b"\n" + n + b"\n)\x81" + a + b"b.",
        "STACK_GLOBAL": b"\x80\x04X" + len(m).to_bytes(4, "little") + m + b"X" + len(n).to_bytes(4, "little") + n
        + b"\x93(" + a + b"tR.",
    }[opcode]


GADGET = {"REDUCE": "touch", "INST": "touch", "OBJ": "touch", "NEWOBJ": "TouchOnNew", "NEWOBJ_EX": "TouchOnNew",
          "BUILD": "TouchOnSetState", "STACK_GLOBAL": "touch"}  # fmt: skip


def _torch_file(pickled: bytes) -> bytes:
    """A torch.save archive whose `data.pkl` is `pickled` (what torch.load reads, by path or stream)."""
    import io
    import zipfile

    buffer = io.BytesIO()
    torch.save({}, buffer)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for item in src.infolist():
            dst.writestr(item, pickled if item.filename.endswith("/data.pkl") else src.read(item.filename))
    return out.getvalue()


def _load_as(form: str, pickled: bytes, root: Path) -> object:
    """`pickled` read as the guards read a checkpoint in `form`: a file under the checkpoint directory by
    path, an object stored in a checkpoint's data file (a stream, while that checkpoint is read), or a DCP
    `.metadata`."""
    import io

    if form == "file":
        target = root / "global_step_1" / "actor" / "model_world_size_1_rank_0.pt"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(_torch_file(pickled))
        return safeload.guard(torch.load, root)(str(target), weights_only=False)
    if form == "stream":
        with safeload.reading(root / "global_step_1" / "actor" / "dist_ckpt"):
            return safeload.guard(torch.load, root)(io.BytesIO(_torch_file(pickled)), weights_only=False)
    return safeload.load_metadata(io.BytesIO(pickled), root / "global_step_1" / ".metadata")


FORMS = ("file", "stream", "metadata")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("opcode", sorted(GADGET))
def test_each_calling_opcode_planted_in_each_checkpoint_format_is_refused_and_has_no_side_effect(
    tmp_path: Path, opcode: str, form: str
) -> None:
    """REDUCE, INST, OBJ, NEWOBJ, NEWOBJ_EX, BUILD (with `__setstate__`) and STACK_GLOBAL, each calling a
    function or class with a side effect: unguarded, the pickle has it (the control); read as a checkpoint
    file, as an object stored in a checkpoint's data, or as a `.metadata`, it is refused and has none."""
    import pickle

    control = tmp_path / "control"
    pickle.loads(_planted(opcode, __name__, GADGET[opcode], str(control)))
    assert control.exists(), "the planted pickle has no side effect of its own: the test would prove nothing"
    marker = tmp_path / "ran"
    named = rf"refused: it (names {__name__}\.{GADGET[opcode]}|uses pickle's {opcode} instruction),"
    with pytest.raises(safeload.RefusedCheckpoint, match=named):
        _load_as(form, _planted(opcode, __name__, GADGET[opcode], str(marker)), tmp_path / "checkpoints")
    assert not marker.exists()


def _imported_names() -> list[tuple[str, str]]:
    """Every name that a module of torch.distributed.checkpoint or Megatron's dist_checkpointing (the
    packages a metadata file's records come from), or of the allowlist, holds and the allowlist does not
    name: what those modules import (functools.partial, operator.itemgetter, torch's TCPStore, thread pools,
    pstats.Stats, ...) and their own functions and classes."""
    import importlib
    import sys

    importlib.import_module("torch.distributed.checkpoint")
    if MCORE:
        importlib.import_module("megatron.core.dist_checkpointing")
    prefixes = ("torch.distributed.checkpoint", "megatron.core.dist_checkpointing")
    modules = sorted({m for m in sys.modules if m.startswith(prefixes)} | set(safeload.METADATA_CLASSES))
    out = []
    for module in modules:
        found = sys.modules.get(module) or importlib.import_module(module)
        allowed = safeload.METADATA_CLASSES.get(module, frozenset())
        out += [(module, name) for name in sorted(vars(found)) if name not in allowed
                and safeload._torch_value(module, name) is None and not name.startswith("__")]  # fmt: skip
    return out


def test_no_name_of_the_metadata_allowlists_modules_but_its_records_is_built(tmp_path: Path) -> None:
    """A `.metadata` naming anything a module of the allowlist holds besides the records it lists (among
    them torch's TCPStore, ThreadPoolExecutor and pstats.Stats) is refused, naming it, before
    anything of the file is built; a file or stored object naming it is refused by the weights-only load."""
    from torch._weights_only_unpickler import _get_allowed_globals

    by_torch = set(_get_allowed_globals())  # torch's own weights-only allowlist ("module.name"): torch's policy
    names = _imported_names()
    for gadget in ("TCPStore", "ThreadPoolExecutor", "Stats"):  # a connection, threads, a file unmarshalled
        assert any(name == gadget for _, name in names), gadget
    for module, name in names:
        for form in FORMS if f"{module}.{name}" not in by_torch else ("metadata",):
            with pytest.raises(safeload.RefusedCheckpoint):
                _load_as(form, _planted("REDUCE", module, name, "x"), tmp_path / "checkpoints")


def test_a_metadata_file_is_checked_whole_before_any_of_it_is_built(tmp_path: Path) -> None:
    """A `.metadata` whose first object is an allowed record and whose later object names a function is
    refused, and the allowed record before it is never constructed (the names are checked on inert
    stand-ins first)."""
    import io

    built: list[object] = []
    from torch.distributed.checkpoint import metadata as dcp_metadata

    original = dcp_metadata.StorageMeta.__init__

    def counting(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        built.append(self)
        original(self, *args, **kwargs)

    dcp_metadata.StorageMeta.__init__ = counting  # type: ignore[method-assign]
    try:
        first = b"\x80\x02ctorch.distributed.checkpoint.metadata\nStorageMeta\n)R"
        second = b"c" + __name__.encode() + b"\ntouch\n(V" + str(tmp_path / "ran").encode() + b"\ntR"
        with pytest.raises(safeload.RefusedCheckpoint):
            safeload.load_metadata(io.BytesIO(first + second + b"\x86."), tmp_path / ".metadata")
        assert built == [] and not (tmp_path / "ran").exists()
        assert isinstance(safeload.load_metadata(io.BytesIO(first + b".")), dcp_metadata.StorageMeta)
    finally:
        dcp_metadata.StorageMeta.__init__ = original  # type: ignore[method-assign]


def test_dcp_bytes_planted_in_a_checkpoint_run_without_the_guard_and_are_refused_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch.distributed.checkpoint save whose stored object (bytes in its data file, as Megatron keeps a
    `ShardedObject`) holds a pickle naming a function: loaded with torch's own reader it runs it (the
    control, outside the checkpoint directory); under the run's checkpoint directory, with the guards as
    the job installs them, it is refused and never runs, while the tensors of a clean save still load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import filesystem

    def save(where: Path, marker: Path) -> None:  # a value that is not a tensor is stored as its torch.save bytes
        dcp.save({"w": torch.arange(4.0), "rng_state": Payload(marker)}, checkpoint_id=str(where), no_dist=True)

    save(tmp_path / "elsewhere", tmp_path / "control-ran")
    dcp.load({"w": torch.zeros(4), "rng_state": None}, checkpoint_id=str(tmp_path / "elsewhere"), no_dist=True)
    assert (tmp_path / "control-ran").exists()

    root = tmp_path / "checkpoints"
    where = root / "global_step_3" / "actor" / "dist_ckpt"
    save(where, tmp_path / "payload-ran")
    reader = filesystem.FileSystemReader
    monkeypatch.setattr(torch, "load", safeload.guard(torch.load, root))
    monkeypatch.setattr(reader, "read_metadata", safeload.guard_metadata(reader.read_metadata, root))
    monkeypatch.setattr(reader, "read_data", safeload.guard_read_data(reader.read_data, root))
    with pytest.raises(BaseException) as refused:  # torch.distributed.checkpoint's CheckpointException wraps it
        dcp.load({"w": torch.zeros(4), "rng_state": None}, checkpoint_id=str(where), no_dist=True)
    assert f"pdmctl: {where} (an object stored in it): refused: it names" in str(refused.value)
    assert not (tmp_path / "payload-ran").exists()
    clean = root / "global_step_4" / "actor" / "dist_ckpt"
    dcp.save({"w": torch.arange(4.0), "step": torch.tensor(4)}, checkpoint_id=str(clean), no_dist=True)
    target = {"w": torch.zeros(4), "step": torch.tensor(0)}
    dcp.load(target, checkpoint_id=str(clean), no_dist=True)
    assert torch.equal(target["w"], torch.arange(4.0)) and int(target["step"]) == 4
