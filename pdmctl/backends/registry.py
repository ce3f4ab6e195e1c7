"""Backends by name: what each adds to the config tree, how it validates a run, how it runs one.

The job entry point and the grid talk to backends only through `Backend`;
each backend lives in its own package and is imported when first used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdmctl.backends.base import Tracker
from pdmctl.backends.datasets import log_datasets, toy_datasets, verl_datasets

# run-config fields every backend receives, flattened: top-level ones and the mask group's
SHARED_FIELDS = ("seed", "delta", "delta_low", "k", "model", "precision", "method", "divergence", "estimator",
                 "eps_low", "eps_high", "ratio_cap", "loss_agg_mode")  # fmt: skip


@dataclass(frozen=True)
class Backend:
    name: str
    defaults: Callable[[], dict[str, Any]]  # the backend group's own fields (backend.<field>=...)
    validate: Callable[[Mapping[str, Any]], None]  # raises ValueError naming the field
    run: Callable[[Mapping[str, Any], Path, Tracker], Mapping[str, float]]  # (flat config, run dir, tracker)
    final_step: Callable[[Mapping[str, Any]], int | None] = lambda flat: int(flat["steps"])  # a tune trial's
    # last evaluation, reported but never pruned (None: not known before the run)
    # the nodes one job of this run holds (at most the profile's `nodes`; fewer: side by side with other runs);
    # None: the profile's (the toy by default: one process on the job's first node, the others held, as the CI's
    # node-loss test needs; backend.nnodes=1 a job of its one node)
    nodes: Callable[[Mapping[str, Any]], int | None] = lambda flat: None
    # before submitting to a cluster (login node): raise ValueError for what the job would fail on
    check_cluster: Callable[[Mapping[str, Any], Mapping[str, Any]], None] = lambda flat, cluster: None
    # what --dry-run prints of the jobs (in array order), given the cluster's settings
    describe: Callable[[list[DescribedRun], Mapping[str, Any]], list[str]] = lambda runs, cluster: []
    # the grid's prefix for the engine's own config keys (verl: `verl.<VeRL key>=v`, kept as backend.verl)
    # what a job records of its run besides the code and the versions (pdmctl.provenance): the data
    # manifest's digest (`data`) and the evaluation's sampling parameters (`eval_sampling`); in the job
    provenance: Callable[[Mapping[str, Any], Path], dict[str, str]] = lambda flat, run_dir: {}
    engine_keys: str | None = None
    # runs of one setting share an engine path (verl: model, precision, strategy): the array starts with one of each
    setting: Callable[[Mapping[str, Any]], str] = lambda flat: f"{flat['model']} {flat['precision']}"
    # at submit, given the cluster's settings: the digest of the data the run will read (its data manifest's),
    # which the run config carries as backend.data_manifest (in the run key); None: no manifest to pin
    data_digest: Callable[[Mapping[str, Any], Mapping[str, Any]], str | None] = lambda flat, cluster: None
    # what each run is expected to cost, given the cluster's settings: run key -> a pdmctl.budget.cost.Estimate, or a
    # line saying why there is none (--dry-run --json)
    estimate: Callable[[list[DescribedRun], Mapping[str, Any]], dict[str, Any]] = (
        lambda runs, cluster: dict.fromkeys((run.key for run in runs), "no cost model for this backend"))
    # the modules a job imports to train: a submission whose jobs would run on this interpreter (the local
    # executor) is refused where one is not installed (orchestrate.check_installed); a dry run needs none
    requires: tuple[str, ...] = ()


@dataclass(frozen=True)
class DescribedRun:
    """A run as --dry-run describes it: its key, its summary line, its flat config, its run directory."""

    key: str
    summary: str
    flat: Mapping[str, Any]
    run_dir: Path


def flat_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A run config as a backend takes it: shared fields flattened, then the backend group's fields."""
    mask = config["mask"]
    flat: dict[str, Any] = {
        "seed": config["seed"],
        "delta": config["delta"],
        "delta_low": config.get("delta_low"),
        "k": config["k"],
        "model": config["model"]["name"],
        "precision": config["precision"]["name"],
        **{
            f: mask[f]
            for f in (
                "method",
                "divergence",
                "estimator",
                "eps_low",
                "eps_high",
                "ratio_cap",
                "loss_agg_mode",
            )
            if f in mask
        },  # fmt: skip
    }
    if config["backend"]["name"] == "toy" and "data" in config:  # the testbed's task: a data plugin's, or the model's
        flat["data"] = config["data"]["name"]
    flat.update({k: v for k, v in config["backend"].items() if k != "name"})
    return flat


# --- toy: the CPU testbed -------------------------------------------------------------------


def _toy_defaults() -> dict[str, Any]:
    from pdmctl.backends.toy import ToyConfig

    return {f.name: f.default for f in dataclasses.fields(ToyConfig) if f.name not in (*SHARED_FIELDS, "data")}


def _toy_validate(flat: Mapping[str, Any]) -> None:
    from pdmctl.backends.toy import ToyConfig, shipped

    cfg = ToyConfig.from_mapping(flat)
    try:  # the base model every job would start from: a bad source, a damaged file or an unusable cache
        if shipped.source_of(cfg.model) == "shipped":  # fails here, not in 8 jobs
            shipped.check_shipped(cfg.model)  # its digest: no torch
        else:  # the warm-up's cache, whose key names the torch version
            from pdmctl.backends.toy import basemodel

            basemodel.check_base_model(cfg.model)
    except shipped.BaseModelError as exc:
        raise ValueError(str(exc)) from None


def _toy_run(flat: Mapping[str, Any], run_dir: Path, tracker: Tracker) -> Mapping[str, float]:
    from pdmctl.backends.toy import ToyConfig, train

    log_datasets(tracker, lambda: toy_datasets(flat))
    return train(ToyConfig.from_mapping(flat), run_dir, tracker)


def _toy_provenance(flat: Mapping[str, Any], run_dir: Path) -> dict[str, str]:
    """The held-out problems (fixed by their seeds) and the evaluation's sampling."""
    import hashlib

    from pdmctl.backends.toy import ToyConfig
    from pdmctl.backends.toy.trainer import task_for

    cfg = ToyConfig.from_mapping(flat)
    task = task_for(cfg)
    h = hashlib.sha256(task.name.encode())
    for name in task.eval_sets:
        problems = task.heldout(name)
        h.update(name.encode() + problems.prompts.numpy().tobytes() + problems.answers.numpy().tobytes())
    return {"data": f"{task.name}:{h.hexdigest()[:16]}",
            "eval_sampling": f"n={cfg.eval_samples} temperature=1.0 top_p=1.0 max_tokens={task.max_response_len}"}


# --- verl: the real engine ------------------------------------------------------------------


def _verl_module(name: str = "launch"):
    """`pdmctl.backends.verl.<name>` (launch: the command; jobbody: the job on its nodes; metrics: names)."""
    try:
        return importlib.import_module(f"pdmctl.backends.verl.{name}")
    except ImportError as exc:  # the [verl] extra is optional
        raise ValueError(f"backend: verl needs the [verl] extra (pip install 'pdmctl[verl]'): {exc}") from exc


def _verl_defaults() -> dict[str, Any]:
    run_identity = {"experiment", "run_name"}  # set by the job from the ledger, not by the user
    launch = _verl_module()
    fields = {k: v for k, v in launch.DEFAULTS.items() if k not in SHARED_FIELDS and k not in run_identity}
    return {**fields, "data_dir": None}  # None: ./data/verl, where `pdmctl data prepare` writes


def _verl_job_config(flat: Mapping[str, Any], run_dir: Path) -> dict[str, Any]:
    # the run's own, else the cluster profile's (exported by the job's setup), else ./data/verl
    data_dir = flat.get("data_dir") or os.environ.get("PDMCTL_DATA_DIR") or Path("data/verl").resolve()
    return {**flat, "data_dir": str(data_dir), "checkpoint_dir": str(run_dir.resolve() / "checkpoints")}


def _verl_unknown_fields(flat: Mapping[str, Any]) -> None:
    """A backend.* key the VeRL backend does not have (`+backend.gpu_memory_utilization=0.8` would change the
    run key and reach nothing): refused, pointing at `verl.<key>` for VeRL's own keys."""
    known = {*SHARED_FIELDS, *_verl_defaults(), "verl"}
    unknown = sorted(set(flat) - known)
    if unknown:
        raise ValueError(f"backend.{unknown[0]}: not a field of backend verl (its fields: "
                         f"{', '.join(sorted(set(_verl_defaults())))}); a VeRL config key is set as verl.<key>, "
                         "e.g. verl.actor_rollout_ref.rollout.gpu_memory_utilization=0.8")  # fmt: skip


# VeRL's ActorConfig.__post_init__ (verl 0.9.1, verl/workers/config/actor.py) accepts these and no other
VERL_LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                       "seq-mean-token-sum-norm")  # fmt: skip
# a run field -> (how the user names it, VeRL's dataclass, its field there): typed by VeRL's own schema
VERL_SCHEMA = {
    "lr": ("backend.lr", "verl.workers.config.FSDPOptimizerConfig", "lr"),
    "temperature": ("backend.temperature", "verl.workers.config.RolloutConfig", "temperature"),
    "val_n": ("backend.val_n", "verl.workers.config.SamplingConfig", "n"),
    "loss_agg_mode": ("mask.loss_agg_mode", "verl.workers.config.FSDPActorConfig", "loss_agg_mode"),
}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


COUNT_MAX = 10**9  # a count beyond this (steps, epochs, nodes) is a typo, never a plan


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= COUNT_MAX


def _path(value: Any, absolute: bool) -> bool:
    return isinstance(value, str) and bool(value.strip()) and (not absolute or Path(value).is_absolute())


# every field of the VeRL backend group (`_verl_defaults`; a test holds the two together): what the job
# would need of it after the queue wait, checked at submit
VERL_FIELD_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "strategy": (lambda v: v is None or v in _verl_module().STRATEGIES, "fsdp2, megatron or null (by the precision)"),
    "lr": (lambda v: v is None or (_number(v) and v > 0), "a number > 0 (or null: the model's)"),
    "temperature": (lambda v: _number(v) and v > 0, "a number > 0"),  # the masks divide the logits by it
    "val_n": (_count, "an integer >= 1 (samples per held-out problem)"),
    "save_freq": (lambda v: v is None or _count(v), "an integer >= 1 (steps between checkpoints: resume needs "
                  "them) or null: the model's"),
    "test_freq": (_count, "an integer >= 1 (steps between evaluations: avg@16 needs them)"),
    "total_epochs": (lambda v: v is None or _count(v), "an integer >= 1 or null: the model's"),
    "max_prompt_length": (_count, "an integer >= 1 (tokens)"),
    "model_path": (lambda v: v is None or _path(v, absolute=False), "a directory or hub id, or null"),
    "nnodes": (lambda v: v is None or _count(v), "an integer >= 1 or null: the model's"),
    "max_ckpt_to_keep": (lambda v: v is None or _count(v), "an integer >= 1 or null: every checkpoint"),
    "total_training_steps": (lambda v: v is None or _count(v), "an integer >= 1 or null: the model's"),
    "data_dir": (lambda v: v is None or _path(v, absolute=True), "an absolute path or null: the profile's"),
    "val_before_train": (lambda v: isinstance(v, bool), "true or false (a validation before the first step)"),
    "skip_old_log_prob": (lambda v: isinstance(v, bool), "true or false (false: VeRL recomputes the old log-probs, "
                          "which no loss of pdmctl's reads)"),
    "data_manifest": (lambda v: v is None or (isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None),
                      "the 64-hex digest of a data manifest (pdmctl data prepare prints it) or null: the data_dir's"),
}


def _verl_fields(flat: Mapping[str, Any]) -> None:
    """The run fields VeRL reads only on the allocation, checked at submit: first against VeRL's own config
    schema (its dataclasses, typed by OmegaConf as VeRL types them) where VeRL is installed, then the values
    VeRL or vLLM would refuse after the queue wait."""
    for field, (name, target, verl_field) in VERL_SCHEMA.items():
        value = flat.get(field)
        if value is not None:
            _verl_schema_check(name, value, target, verl_field)
    defaults = _verl_defaults()
    for field, (check, wanted) in VERL_FIELD_CHECKS.items():
        value = flat.get(field, defaults[field])
        if not check(value):
            if isinstance(value, int) and not isinstance(value, bool) and value > COUNT_MAX:
                wanted = f"at most {COUNT_MAX:,}"
            raise ValueError(f"backend.{field}: must be {wanted}, got {value!r:.80}")
    mode = flat.get("loss_agg_mode", "token-mean")
    if mode not in VERL_LOSS_AGG_MODES:
        raise ValueError(f"mask.loss_agg_mode: unknown {mode!r}; VeRL takes {', '.join(VERL_LOSS_AGG_MODES)}")


def _verl_schema_check(name: str, value: Any, target: str, verl_field: str) -> None:
    """VeRL's own type for the field (nothing when VeRL is not installed where the sweep is submitted)."""
    from pdmctl.backends.verl.schema import check_field

    check_field(name, value, target, verl_field)


def _verl_validate(flat: Mapping[str, Any]) -> None:
    """Build the job's overrides and parse each with Hydra's own parser, as the job will after the queue wait."""
    from pdmctl.backends.verl.quoting import OverrideError, check_overrides

    launch = _verl_module()
    _verl_unknown_fields(flat)
    _verl_fields(flat)
    cfg = _verl_job_config(flat, Path("/pdmctl-validate"))
    try:
        check_overrides(launch.verl_overrides(cfg) + launch.ray_env_overrides(launch.job_env(cfg)))
    except OverrideError as exc:
        raise ValueError(str(exc)) from None


def _verl_run(flat: Mapping[str, Any], run_dir: Path, tracker: Tracker) -> Mapping[str, float]:
    """Run VeRL inside the job (Ray across the SLURM allocation), logging into the ledger's MLflow run."""
    jobbody, metrics = _verl_module("jobbody"), _verl_module("metrics")
    uri, run_id = getattr(tracker, "uri", None), getattr(tracker, "run_id", None)
    if uri is None or run_id is None:
        raise ValueError("backend: verl logs through MLflow itself and needs the job's ledger tracker")
    _verl_check_data(flat, run_dir)
    log_datasets(tracker, lambda: _verl_datasets(flat, run_dir))
    cfg = {**_verl_job_config(flat, run_dir), "tracking_uri": uri, "mlflow_run_id": run_id}
    report = getattr(tracker, "report_evaluation", None)  # a tune trial's, a collapse rule's (pdmctl.budget.collapse)
    from pdmctl import wayout

    def on_line(line: str) -> None:  # each step VeRL prints goes to the trial and the rule, which may end it
        wayout.requeue_on(line)  # the trainer's checkpoint on the way out: the job requeues now
        if report is not None and (found := metrics.step_metrics_from_line(line)) is not None:
            report(found[1], found[0])

    from pdmctl.ledger.spool import flush_run

    # what an earlier attempt could not send goes first (the TaskRunner then reads what is logged)
    flush_run(run_dir.resolve(), uri, run_id)
    try:
        jobbody.run(cfg, python=sys.executable, on_line=on_line)
    except BaseException:
        with contextlib.suppress(Exception):  # what VeRL logged so far, under pdmctl's names too
            flush_run(run_dir.resolve(), uri, run_id, limit_s=60.0)
            tracker.copy_metrics(metrics.pdmctl_metric_name)
        raise
    flush_run(run_dir.resolve(), uri, run_id)  # what the TaskRunner kept while the server was down
    # VeRL's names -> eval/aime24, train/reward, ...: logged live by the TaskRunner (resume.py); this copies
    # what it did not (an older attempt's), no step twice
    return tracker.copy_metrics(metrics.pdmctl_metric_name)


def _verl_provenance(flat: Mapping[str, Any], run_dir: Path) -> dict[str, str]:
    """The data the job trains and validates on (its manifest's digest, else the parquet files' digest), and
    the validation's sampling."""
    cfg, preset, _, digest = _verl_data(flat, run_dir)
    return {"data": digest,
            "eval_sampling": f"n={cfg.get('val_n', 16)} temperature={cfg.get('temperature', 1.0)} top_p=1.0 "
                             f"max_tokens={preset.max_response_length}"}  # fmt: skip


def _verl_datasets(flat: Mapping[str, Any], run_dir: Path) -> list[dict[str, Any]]:
    """The parquet files as MLflow inputs, with the digest the run config pinned (else the one found)."""
    _, _, files, found = _verl_data(flat, run_dir)
    return verl_datasets(files, str(flat.get("data_manifest") or found))


def _verl_data(flat: Mapping[str, Any], run_dir: Path) -> tuple[dict[str, Any], Any, list[Path], str]:
    """The job's config, its model preset, the parquet files it trains and validates on (the training file
    first) and their digest: their manifest's, else the files' own."""
    from pdmctl.provenance import file_digest

    launch = _verl_module()
    cfg = _verl_job_config(flat, run_dir)
    preset = launch.MODEL_PRESETS[cfg["model"]]
    data_dir = Path(cfg["data_dir"])
    if preset.hf_path is None and not cfg.get("model_path"):  # built on this machine: the job reads its data there
        data_dir = launch.local_model_dir(cfg["model"]) / "data"  # (`resolve_local_model`; not built here)
    files = [data_dir / preset.train_file, *(data_dir / f for f in launch.VAL_FILES)]
    try:
        from pdmctl.backends.verl import data

        digest = data.read_manifest(data_dir, verify=False)["digest"]
    except (ValueError, OSError):
        digest = file_digest(files)
    return cfg, preset, files, str(digest)


def _verl_data_dir(flat: Mapping[str, Any], cluster: Mapping[str, Any]) -> Path:
    """Where a run reads its data: its own data_dir, else the profile's, else ./data/verl (`_verl_job_config`)."""
    return Path(str(flat.get("data_dir") or cluster.get("data_dir") or Path("data/verl").resolve()))


def _verl_data_digest(flat: Mapping[str, Any], cluster: Mapping[str, Any]) -> str | None:
    """The digest of the run's data manifest (checked against the files beside it), pinned into the run config
    at submit; None where the preset builds its own data (qwen3-tiny) or the data directory holds no data here
    (an offline cluster refuses that in `check_cluster`; elsewhere the job fails on it). Files without a
    manifest, a corrupt manifest or a file changed since it was prepared: ValueError, one line."""
    launch = _verl_module()
    preset = launch.MODEL_PRESETS.get(str(flat.get("model")))
    if preset is None or preset.hf_path is None:
        return None
    data_dir = _verl_data_dir(flat, cluster)
    from pdmctl.backends.verl import data

    try:
        if not (data_dir / data.MANIFEST).exists() and not any((data_dir / f).exists()
                                                               for f in (preset.train_file, *launch.VAL_FILES)):
            return None
        return _manifest_digest(str(data_dir), _stamp(data_dir))
    except OSError as exc:  # a path the file system cannot hold (a name too long), a loop of links
        name = str(exc.filename or data_dir)
        raise ValueError(f"{name[:60]}{'...' if len(name) > 60 else ''}: {exc.strerror or exc}") from None


def _stamp(data_dir: Path) -> tuple:
    """What changes when a prepared directory changes (its files' sizes and times): the digest's cache key."""
    out = []
    for path in sorted(data_dir.iterdir()) if data_dir.is_dir() else []:
        try:
            st = path.stat()
        except OSError:
            continue
        out.append((path.name, st.st_size, st.st_mtime_ns))
    return tuple(out)


@functools.lru_cache(maxsize=16)
def _manifest_digest(data_dir: str, stamp: tuple) -> str:
    from pdmctl.backends.verl import data

    try:
        return str(data.read_manifest(data_dir)["digest"])
    except data.ManifestError as exc:
        raise ValueError(str(exc)) from None


def _verl_check_data(flat: Mapping[str, Any], run_dir: Path) -> None:
    """In the job, before VeRL starts: the data directory still holds the data the run was submitted with."""
    pinned = flat.get("data_manifest")
    if not pinned:
        return
    data_dir = Path(_verl_job_config(flat, run_dir)["data_dir"])
    from pdmctl.backends.verl import data

    found = data.read_manifest(data_dir)["digest"]  # ManifestError: one line, the run FAILED with it
    if found != pinned:
        raise ValueError(f"{data_dir}: holds data {found[:16]}, and this run was submitted on data {pinned[:16]} "
                         "(backend.data_manifest): prepare that data again, or submit the run again")


def _verl_check_cluster(flat: Mapping[str, Any], cluster: Mapping[str, Any]) -> None:
    """An offline cluster (`Executor.job_settings`): the weights and data are on its shared storage."""
    if cluster.get("offline") and cluster.get("look_at_storage", True):
        launch = _verl_module()
        try:
            launch.check_local_files(flat, cluster.get("models_dir"), flat.get("data_dir") or cluster.get("data_dir")
                                     or str(Path("data/verl").resolve()))  # fmt: skip
        except OSError as exc:  # a path the file system cannot hold (a name too long), a loop of links
            name = str(exc.filename or "")
            raise ValueError(f"{name[:60]}{'...' if len(name) > 60 else ''}: {exc.strerror or exc}") from None


def _verl_describe(runs: list[DescribedRun], cluster: Mapping[str, Any], estimate: bool = False) -> Any:
    """Every distinct VeRL command by setting, each run under its command, the cost (`describe.describe_jobs`);
    with `estimate`, each run's expected cost instead (`describe.estimate_jobs`)."""
    if not runs:
        return {} if estimate else []
    launch = _verl_module()
    from pdmctl.backends.verl import describe

    environ = {var: str(cluster[name]) for var, name in (("PDMCTL_MODELS_DIR", "models_dir"),
               ("PDMCTL_DATA_DIR", "data_dir"), ("PDMCTL_NCCL_TIMEOUT", "nccl_timeout")) if cluster.get(name)}  # fmt: skip
    if cluster.get("offline"):
        environ.update(dict.fromkeys(launch.OFFLINE_ENV, "1"))
    environ.update(cluster.get("env") or {})
    environ.update(cluster.get("network") or {})  # the profile's network: (slurm_options.NETWORK_VARIABLES)
    jobs = []
    for run in runs:
        cfg = {**run.flat, "data_dir": run.flat.get("data_dir") or environ.get("PDMCTL_DATA_DIR")}
        job = {**_verl_job_config(cfg, run.run_dir), "mlflow_run_id": "RUN_ID",
               "tracking_uri": cluster.get("tracking_uri") or "TRACKING_URI"}  # fmt: skip
        jobs.append(describe.Job(run.key, run.summary, launch.setting(job), job))
    if estimate:
        return describe.estimate_jobs(jobs, int(cluster.get("nodes") or 1), environ, cluster)
    return describe.describe_jobs(jobs, int(cluster.get("nodes") or 1), environ, cluster)


def _toy_estimate(runs: list[DescribedRun], cluster: Mapping[str, Any]) -> dict[str, Any]:
    from pdmctl.budget.cost import toy_estimate

    return {run.key: toy_estimate(run.flat, cluster) for run in runs}


def _synthetic() -> Backend:
    from pdmctl.backends import synthetic

    return Backend("synthetic", synthetic.defaults, synthetic.validate, synthetic.run)


BACKENDS: dict[str, Backend] = {
    "toy": Backend("toy", _toy_defaults, _toy_validate, _toy_run, nodes=lambda flat: flat.get("nnodes"),
                   provenance=_toy_provenance, estimate=_toy_estimate, requires=("torch",)),  # fmt: skip
    "verl": Backend("verl", _verl_defaults, _verl_validate, _verl_run, lambda flat: _verl_module().final_step(flat),
                    lambda flat: _verl_module().run_nodes(_verl_job_config(flat, Path("/pdmctl-validate"))),
                    _verl_check_cluster, _verl_describe, provenance=_verl_provenance, engine_keys="verl",
                    setting=lambda flat: _verl_module().setting(_verl_job_config(flat, Path("/pdmctl-validate"))),
                    data_digest=_verl_data_digest,
                    estimate=lambda runs, cluster: _verl_describe(runs, cluster, estimate=True)),  # fmt: skip
    "synthetic": _synthetic(),  # a known objective for pdmctl tune's tests and benchmark
}


def run_nodes(spec: Any) -> int | None:
    """The nodes a run's job asks for: its backend's count for it (None, or no spec: the profile's `nodes`)."""
    return None if spec is None else get_backend(spec.backend).nodes(flat_config(spec.config))


def check_installed(names: Iterable[str]) -> None:
    """ValueError in one line where a backend's run needs a module (`Backend.requires`) this interpreter
    cannot import; looked up, not imported (a dry run and a submission stay free of torch)."""
    import importlib.util

    for name in sorted(set(names)):
        for module in get_backend(name).requires:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):  # a parent that does not import, a module set to None
                found = False
            if not found:
                raise ValueError(f"{module} is not installed in {sys.executable}, and the {name} backend's runs "
                                 f"train with it: {_install_hint(module)}")


def _install_hint(module: str) -> str:
    """How to install a module pdmctl's runs need: the extra that brings it (`pip install 'pdmctl[testbed]'`,
    its requirement beside it), else its bare name."""
    from importlib import metadata

    try:
        wanted = metadata.requires("pdmctl") or []
    except metadata.PackageNotFoundError:
        wanted = []
    for requirement in wanted:
        spec, _, marker = requirement.partition(";")
        if not re.match(rf"{re.escape(module)}\s*([<>=!~\[]|$)", spec.strip()):
            continue
        extra = re.search(r"extra\s*==\s*['\"]([\w-]+)['\"]", marker)
        if extra is None:
            return f"pip install {spec.strip()!r} (pdmctl's requirement)"
        if extra.group(1) != "dev":
            return f"pip install 'pdmctl[{extra.group(1)}]' (or {spec.strip()!r})"
    return f"pip install {module!r}"


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"backend: unknown {name!r}; choose from {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name]
