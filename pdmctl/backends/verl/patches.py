"""The monkeypatches that carry the rollout's top-K through VeRL 0.9.1 and call pdmctl's actor loss.

`install` patches, where each module imports: VeRL's vLLM server (request `logprobs=K`
as vLLM's flat lists, keep `TopK ∪ {k}` per generated token in the output's extra
fields), the V0 agent loop (extra fields -> the batch's per-response arrays,
`topk.carry_topk`), V1's TransferQueue hand-over (the same, per sample) and the actor
worker (use `actor_loss.pdm_ppo_loss`, switch VeRL's logits-processor hook on).
Every plugin import in a Ray worker calls it (plugin.py); it is idempotent.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Mapping
from typing import Any

import torch

from pdmctl.backends.verl import snapshot
from pdmctl.backends.verl.actor_loss import pdm_ppo_loss
from pdmctl.backends.verl.topk import (
    FAIL_ENV,
    FLAT_LOGPROBS_LINE,
    TOPK_ENV,
    TOPK_IDS_KEY,
    TOPK_LOGPROBS_KEY,
    RolloutTopK,
    _is_flat,
    carry_topk,
    check_verl_version,
    extract_topk,
    int32_ids,
    is_pdmctl_loss,
)


def configured_topk() -> int:
    """K from the environment the job body exports to every Ray worker; 0 = the patch is off."""
    raw = os.environ.get(TOPK_ENV, "0")
    try:
        return int(raw)
    except ValueError as err:
        raise ValueError(f"{TOPK_ENV}: expected an integer K, got {raw!r}") from err


_INSTALLED: set[str] = set()
_ANNOUNCED: set[str] = set()
_K = [0]  # the K the installed patches use; the latest `install` sets it (one K per process)


def install(k: int | None = None) -> None:
    """Patch VeRL 0.9.1 to carry rollout top-K and to call pdmctl's actor loss. Idempotent.

    Each part is installed only where its module imports: the vLLM server exists
    only where vLLM is installed, the actor worker only where its engines import.
    """
    check_verl_version()
    k = configured_topk() if k is None else k
    if k < 1:
        return
    _K[0] = k
    _patch_actor_worker()
    _patch_bypass()
    _patch_agent_loop()
    _patch_agent_loop_tq()
    _patch_vllm_server()


def announce(what: str) -> None:
    """`pdmctl: <what> on <host> (pid N)`, once per process: where VeRL placed its actor ranks and
    rollout servers. Ray passes a worker's output to the driver, so it reaches the job log (read by
    tests/test_verl_multinode.py: the actor's ranks and the rollout on both nodes)."""
    import socket

    if what in _ANNOUNCED:
        return
    _ANNOUNCED.add(what)
    print(f"pdmctl: {what} on {socket.gethostname()} (pid {os.getpid()})", flush=True)


def _actor_rank() -> str:
    """`rank R of W` of this actor process (VeRL's worker group sets RANK and WORLD_SIZE)."""
    return f"rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')}"


def _patch_actor_worker() -> None:
    """Use `pdm_ppo_loss` when the loss mode is pdmctl's, and switch VeRL's logits-processor hook on."""
    if "actor" in _INSTALLED:
        return
    from verl.workers import engine_workers

    original_init_model = engine_workers.ActorRolloutRefWorker.init_model
    original_train_batch = engine_workers.TrainingWorker.train_batch
    original_train_mini_batch = engine_workers.TrainingWorker.train_mini_batch

    @functools.wraps(original_init_model)
    def init_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        # VeRL's checkpoint rotation told what earlier attempts kept; here, in the actor process, not at the
        # plugin's import: importing VeRL's checkpoint manager resolves VeRL's platform, and a vLLM worker
        # imports the plugin before the CPU platform is registered ("Unknown platform 'cpu'", seen)
        from pdmctl.backends.verl import checkpoints, safeload

        checkpoints.install()
        safeload.install_dcp()  # Megatron's checkpoints: torch.distributed.checkpoint's metadata
        result = original_init_model(self, *args, **kwargs)
        if getattr(self, "actor", None) is not None and is_pdmctl_loss(
            self.config.actor.policy_loss.loss_mode
        ):
            self.loss_fn = functools.partial(pdm_ppo_loss, config=self.loss_fn.keywords["config"])
            self.actor.set_loss_fn(self.loss_fn)
        if getattr(self, "actor", None) is not None:
            announce(f"actor {_actor_rank()} initialised")
        return result

    @functools.wraps(original_train_batch)
    def train_batch(self: Any, data: Any) -> Any:
        # The engines call a loss function as logits processor only under this flag (its
        # only user in 0.9.1 is top-K distillation, which pdmctl runs never enable).
        if getattr(self.loss_fn, "func", None) is pdm_ppo_loss:
            from verl.utils import tensordict_utils as tu

            tu.assign_non_tensor(data, distillation_use_topk=True)
        result = snapshot.train_batch(self, data, original_train_batch)  # PDMCTL_VERL_SNAPSHOT_STEP's step
        announce(f"actor {_actor_rank()} trained a batch")
        return result

    @functools.wraps(original_train_mini_batch)
    def train_mini_batch(self: Any, data: Any) -> Any:
        snapshot.begin_step()  # one call per training step: the step its mini-batches belong to
        return original_train_mini_batch(self, data)

    engine_workers.ActorRolloutRefWorker.init_model = init_model
    engine_workers.TrainingWorker.train_batch = train_batch
    engine_workers.TrainingWorker.train_mini_batch = train_mini_batch
    _INSTALLED.add("actor")


def _patch_bypass() -> None:
    """VeRL's V0 trainer, with `algorithm.rollout_correction.bypass_mode` (every pdmctl run: its losses read
    the rollout's log-probs, never a recomputed `old_log_probs`), takes `old_log_probs` from the rollout and
    skips the recompute forward, and also renames the loss mode to its own `bypass_mode` loss. Where the loss
    is pdmctl's, only the first is done: the loss stays pdmctl's (V1's trainer renames nothing)."""
    if "bypass" in _INSTALLED:
        return
    try:
        from verl.trainer.ppo import rollout_corr_helper
    except ImportError:  # a process without VeRL's trainer (a vLLM worker)
        return
    original = rollout_corr_helper.apply_bypass_mode

    @functools.wraps(original)
    def apply_bypass_mode(batch: Any, rollout_corr_config: Any = None, policy_loss_config: Any = None) -> None:
        if policy_loss_config is not None and is_pdmctl_loss(str(policy_loss_config.get("loss_mode", ""))):
            if "rollout_log_probs" not in batch.batch:
                raise ValueError("bypass_mode: the batch holds no rollout_log_probs (rollout.calculate_log_probs)")
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
            return None
        return original(batch, rollout_corr_config=rollout_corr_config, policy_loss_config=policy_loss_config)

    rollout_corr_helper.apply_bypass_mode = apply_bypass_mode
    _INSTALLED.add("bypass")


def _patch_agent_loop() -> None:
    """Put each response's top-K from `extra_fields` into the batch as `carry_topk` lays it out."""
    if "agent_loop" in _INSTALLED:
        return
    from verl.experimental.agent_loop import agent_loop

    original = agent_loop.AgentLoopWorker._postprocess

    @functools.wraps(original)
    def _postprocess(self: Any, inputs: list[Any], *args: Any, **kwargs: Any) -> Any:
        k = _K[0]
        supports = [_support_from_extra_fields(item.extra_fields) for item in inputs]
        output = original(self, inputs, *args, **kwargs)
        batch = output.batch
        sampled_logprobs = _rollout_log_probs(batch.get("rollout_log_probs", None))
        ids, logprobs = carry_topk(supports, batch["responses"], batch["response_mask"], sampled_logprobs, k)
        # VeRL's _postprocess put every extra field in non_tensor_batch as an object array: these replace
        # the server's [T, K+1] ones
        output.non_tensor_batch[TOPK_IDS_KEY] = ids
        output.non_tensor_batch[TOPK_LOGPROBS_KEY] = logprobs
        return output

    agent_loop.AgentLoopWorker._postprocess = _postprocess
    _INSTALLED.add("agent_loop")


def v1_available() -> bool:
    """Whether VeRL's V1 trainer can run here: its agent loop needs TransferQueue. Looked up, not
    imported: importing VeRL's trainer from a worker's plugin import would ask for the device
    platform before cpu.py has registered it."""
    return importlib.util.find_spec("transfer_queue") is not None


def _patch_agent_loop_tq() -> None:
    """The V1 trainer: each output's top-K becomes two per-sample tensor fields in TransferQueue.

    V1's `_agent_loop_postprocess` turns every AgentLoopOutput into a dict of per-sample fields
    (`responses` [T], `rollout_log_probs` [T], ...) and stores them with one
    `list_of_dict_to_tensordict` call; the actor's `update_actor` then fetches every field of its
    keys. pdmctl moves the top-K lists from `extra_fields` into `rollout_topk_ids` /
    `rollout_topk_logprobs` [T, K] there (`carry_topk`'s layout, one sample), checked as in V0. The
    function is wrapped where VeRL defines it (a light module), before the V1 agent loop imports
    it by name; dicts without top-K lists pass through untouched.
    """
    if "agent_loop_tq" in _INSTALLED:
        return
    from verl.utils import tensordict_utils

    original = tensordict_utils.list_of_dict_to_tensordict

    @functools.wraps(original)
    def list_of_dict_to_tensordict(fields: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
        for field in fields:
            extra = field.get("extra_fields")
            if isinstance(extra, dict) and TOPK_IDS_KEY in extra and "responses" in field:
                support = _support_from_extra_fields(extra)
                rollout_log_probs = _rollout_log_probs(field.get("rollout_log_probs"))
                responses, response_mask = field["responses"][None], field["response_mask"][None]
                ids, logprobs = carry_topk([support], responses, response_mask, rollout_log_probs[None], _K[0])
                field[TOPK_IDS_KEY] = torch.from_numpy(ids[0])
                field[TOPK_LOGPROBS_KEY] = torch.from_numpy(logprobs[0])
                for key in (TOPK_IDS_KEY, TOPK_LOGPROBS_KEY):
                    extra.pop(key, None)
        return original(fields, *args, **kwargs)

    tensordict_utils.list_of_dict_to_tensordict = list_of_dict_to_tensordict
    for name in ("verl.trainer.ppo.v1.agent_loop_tq", "verl.trainer.ppo.padding_utils"):
        module = sys.modules.get(name)  # imported before this patch: rebind its copy of the name
        if module is not None:
            module.list_of_dict_to_tensordict = list_of_dict_to_tensordict
    _INSTALLED.add("agent_loop_tq")


def _rollout_log_probs(value: torch.Tensor | None) -> torch.Tensor:
    if value is None:
        raise RuntimeError(
            "pdmctl losses need the rollout's sampled log-probs: set actor_rollout_ref.rollout.calculate_log_probs=true"
        )
    return value


def _support_from_extra_fields(extra_fields: Mapping[str, Any]) -> RolloutTopK:
    ids = extra_fields.get(TOPK_IDS_KEY)
    if ids is None:
        raise RuntimeError("a rollout came back without top-K log-probs: the vLLM server patch is not active")
    # the server's int32 arrays, taken without a copy (lists, from older servers or tests: int64)
    return RolloutTopK(torch.as_tensor(ids), torch.as_tensor(extra_fields[TOPK_LOGPROBS_KEY]))


def _patch_vllm_server() -> None:
    """Request `logprobs=K` from vLLM and keep `TopK ∪ {k}` per generated token."""
    if "vllm" in _INSTALLED:
        return
    try:
        from verl.workers.rollout.vllm_rollout import vllm_async_server as server
    except (ImportError, ValueError):  # no vLLM on this node (the driver, CPU tests): verl raises either
        return

    original_sampling_params = server.SamplingParams
    original_generate = server.vLLMHttpServer.generate

    def sampling_params(*args: Any, **kwargs: Any) -> Any:
        # VeRL asks for `logprobs=0` (the sampled token only) when calculate_log_probs is on.
        if kwargs.get("logprobs") == 0:
            kwargs["logprobs"] = _K[0]
            # flat lists instead of a {token_id: Logprob} dict per position: vLLM builds K+1 objects
            # less per token, `extract_topk` reads the lists as arrays (bench/topk.py); VeRL's own
            # read of the sampled token's log-prob takes it as the sequence of dicts it still is
            if "flat_logprobs" in getattr(original_sampling_params, "__struct_fields__", ()):
                kwargs.setdefault("flat_logprobs", True)
        return original_sampling_params(*args, **kwargs)

    @functools.wraps(original_generate)
    async def generate(
        self: Any, prompt_ids: Any, sampling_params: Any, request_id: str, **kwargs: Any
    ) -> Any:
        if os.environ.get(FAIL_ENV) == "rollout":
            raise RuntimeError(f"pdmctl: failure injected in the rollout worker ({FAIL_ENV}=rollout)")
        announce(f"rollout server {getattr(self, 'replica_rank', '?')} generates")
        captured = _capture_final_outputs(self)
        output = await original_generate(self, prompt_ids, sampling_params, request_id, **kwargs)
        final = captured.pop(request_id, None)
        if final is not None and final.outputs and final.outputs[0].logprobs is not None:
            support = extract_topk(final.outputs[0].token_ids, final.outputs[0].logprobs, _K[0])
            if "flat-seen" not in _INSTALLED and _is_flat(final.outputs[0].logprobs):
                _INSTALLED.add("flat-seen")  # once per server process: the engine test looks for it
                print(f"pdmctl: top-K read from vLLM's flat logprobs ({FLAT_LOGPROBS_LINE})", flush=True)
            # numpy arrays, not lists nor tensors: Ray pickles an array's buffer out of band, about
            # memory speed, where a [8192, 21] tensor pickled ~4x slower and the nested lists ~30x; the
            # agent loop takes them back with `torch.as_tensor`, without a copy (bench/topk.py). Ids in
            # 32 bits, as the batch carries them (carry_topk)
            output.extra_fields[TOPK_IDS_KEY] = int32_ids(support.ids).numpy()
            output.extra_fields[TOPK_LOGPROBS_KEY] = support.logprobs.numpy()
        return output

    server.SamplingParams = sampling_params
    server.vLLMHttpServer.generate = generate
    _INSTALLED.add("vllm")


def _capture_final_outputs(server_instance: Any) -> dict[str, Any]:
    """Wrap this server's engine.generate once so the last RequestOutput per request is kept."""
    captured: dict[str, Any] | None = getattr(server_instance, "_pdmctl_final_outputs", None)
    if captured is not None:
        return captured
    from pdmctl.backends.verl import progress

    captured = {}
    engine_generate = server_instance.engine.generate

    async def generate(*args: Any, request_id: str, **kwargs: Any) -> Any:
        tokens = 0
        async for item in engine_generate(*args, request_id=request_id, **kwargs):
            captured[request_id] = item
            # the tokens generated so far (vLLM streams cumulative outputs): the job's stall watchdog reads
            # them, so that a rollout that prints nothing for minutes is not taken for a hang (progress.py)
            now = sum(len(getattr(out, "token_ids", ()) or ()) for out in getattr(item, "outputs", ()) or ())
            progress.add("tokens", now - tokens if now >= tokens else now)
            tokens = now
            yield item

    server_instance.engine.generate = generate
    server_instance._pdmctl_final_outputs = captured
    return captured
