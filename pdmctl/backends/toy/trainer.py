"""The RL loop: rollout, GRPO advantages, mini-batch updates through pdmctl.masks, eval, checkpoints.

Resumption is exact on CPU: a checkpoint holds the weights, Adam's state, the
training RNG and the step; evaluation draws from its own generator seeded by
(seed, step), so neither evaluating nor resuming changes what training samples.

`train(..., device="cuda")` trains on a GPU (scripts/device-check.sh): the policy, the rollout
engine and the batches live there; every random draw still comes from the run's CPU generator.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from pdmctl import masks, preflight, testhooks, wayout
from pdmctl.backends.base import Tracker
from pdmctl.backends.toy import task
from pdmctl.backends.toy.basemodel import load_base_model, save_atomically
from pdmctl.backends.toy.config import ToyConfig
from pdmctl.backends.toy.model import PRECISIONS, TinyTransformer, forward
from pdmctl.backends.toy.rollout import Rollout, RolloutEngine
from pdmctl.backends.toy.tasks import TASKS, Task, task_of

EVAL_SETS = ("toy24", "toy25")
CPU = torch.device("cpu")
HOLD_ENV, HOLD_S_ENV = "PDMCTL_TOY_HOLD_AT_STEP", "PDMCTL_TOY_HOLD_S"  # tests only: hold at the end of this step
FAIL_ENV = "PDMCTL_TOY_FAIL_AT_STEP"  # tests only: fail after this checkpoint
LOSE_NODE_ENV = "PDMCTL_TOY_LOSE_NODE_AT_STEP"  # tests only: a lost node's failure after this checkpoint
BREAK_ENV = "PDMCTL_TOY_BREAK"  # tests only: real failures of a fresh run by mask method (testhooks.breaks)
KEEP_CHECKPOINTS = 2
_UPDATE_METRICS = ("mask_frac", "out_of_region_frac", "mean_divergence", "ppo_kl")  # token-weighted means


def task_for(cfg: ToyConfig) -> Task:
    """The task a run trains and evaluates on: its data plugin's (`data=<name>`, pdmctl.plugins), else its model
    preset's."""
    if cfg.data != "toy":
        from pdmctl import plugins

        return plugins.testbed_task(cfg.data)
    return task_of(cfg.model)


def masked_loss(logits, batch, advantages, resp_mask, cfg) -> tuple:
    """`masks.policy_loss` of a rollout batch with the run config's mask settings (MATH.md): the one
    loss the training step and the direction analysis's criteria take."""
    return masks.policy_loss(
        logits,
        batch.sampled_ids,
        batch.topk_ids,
        batch.topk_logprobs,
        batch.sampled_logprobs,
        advantages.unsqueeze(1).expand_as(resp_mask),
        resp_mask,
        method=cfg.method,
        divergence=cfg.divergence,
        estimator=cfg.estimator,
        delta=cfg.delta,
        delta_low=cfg.delta_low,
        eps_low=cfg.eps_low,
        eps_high=cfg.eps_high,
        loss_agg_mode=cfg.loss_agg_mode,
        ratio_cap=cfg.ratio_cap,
    )


@dataclass
class Learner:
    """The trained state and everything that moves it (what a checkpoint must restore)."""

    policy: TinyTransformer
    optimizer: torch.optim.Adam
    engine: RolloutEngine
    generator: torch.Generator  # training randomness: problems, sampling, mini-batch order
    task: Task = TASKS["addition"]  # the preset's task (tasks.task_of)
    device: torch.device = CPU  # where the policy, the engine and the batches live

    @classmethod
    def from_base(cls, cfg: ToyConfig, device: torch.device | str | None = None) -> Learner:
        device = torch.device(device or "cpu")
        policy = load_base_model(cfg.model).to(device)
        the_task = task_for(cfg)
        return cls(
            policy=policy,
            optimizer=torch.optim.Adam(policy.parameters(), lr=cfg.lr),
            engine=RolloutEngine(
                policy, PRECISIONS[cfg.precision].rollout, cfg.k, the_task.max_response_len, the_task.kv_cache
            ),
            generator=torch.Generator().manual_seed(cfg.seed),
            task=the_task,
            device=device,
        )

    def rollout(self, problems: task.Problems) -> Rollout:
        self.engine.sync(self.policy)
        return self.engine.generate(problems.prompts.to(self.device), self.generator)

    def update(
        self, batch: Rollout, advantages: torch.Tensor, cfg: ToyConfig, shape: bool = False
    ) -> dict[str, float]:
        """One optimizer step on the rows of `batch`; the mask's metrics over its response tokens (with
        `shape`, also the policy's entropy and top-K mass there before the step: policy_shape)."""
        resp_mask = self.task.response_mask(batch.sampled_ids)
        logits = forward(
            self.policy, batch.tokens[:, :-1], self.task.max_response_len, PRECISIONS[cfg.precision].train
        )
        loss, metrics = masked_loss(logits, batch, advantages, resp_mask, cfg)
        self.optimizer.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.grad_clip)
        self.optimizer.step()
        metrics = {**metrics, "grad_norm": float(norm)}  # before clipping (the analysis's decomposition)
        return {**metrics, **policy_shape(logits.detach(), resp_mask, cfg.k, batch)} if shape else metrics

    def state_dict(self, step: int, cfg: ToyConfig) -> dict[str, object]:
        return {
            "step": step,
            "config": dataclasses.asdict(cfg),
            "policy": self.policy.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: Mapping[str, object]) -> int:
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        return int(state["step"])


def policy_shape(logits: torch.Tensor, resp_mask: torch.Tensor, k: int, batch: Rollout | None = None) -> dict[str, float]:
    """The policy's mean token entropy (nats) and mean top-K mass over the response tokens, from the
    training forward's logits [B, T, V] (before the update): what an LLM run's entropy curve shows.

    With the rollout `batch`, also the rollout/trainer gap as VeRL's `training/rollout_probs_diff_mean`
    measures it: the mean over response tokens of |π(y_t) − μ(y_t)|, the trainer's probability of the
    sampled token against the engine's. On a step's first mini-batch, before its update, both hold the
    same weights: the gap is the precision's alone (fp8 or bf16 rollout against the float32 trainer)."""
    with torch.no_grad():
        log_pi = torch.log_softmax(logits.float(), -1)
        pi = log_pi.exp()
        entropy = -(pi * log_pi).sum(-1)
        topk_mass = pi.topk(min(k, pi.shape[-1]), -1).values.sum(-1)
        n = resp_mask.sum().clamp_min(1)
        out = {
            "entropy": float((entropy * resp_mask).sum() / n),
            "topk_mass": float((topk_mass * resp_mask).sum() / n),
        }
        if batch is not None:
            sampled = pi.gather(-1, batch.sampled_ids.unsqueeze(-1)).squeeze(-1)
            gap = (sampled - batch.sampled_logprobs.float().exp()).abs()
            out["rollout_probs_diff_mean"] = float((gap * resp_mask).sum() / n)
        return out


def grpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """A = (R − mean of the group) / (std of the group + ε); a group is group_size consecutive rows."""
    grouped = rewards.view(-1, group_size)
    centered = grouped - grouped.mean(1, keepdim=True)
    return (centered / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)


def train_step(learner: Learner, cfg: ToyConfig) -> dict[str, float]:
    """Rollout one batch, then `minibatches` updates on it in a random order; the step's metrics."""
    problems = learner.task.sample_train(cfg.prompts_per_step, learner.generator).repeat(cfg.group_size)
    problems = problems.to(learner.device)
    batch = learner.rollout(problems)
    rewards = learner.task.score(problems, batch.sampled_ids)
    advantages = grpo_advantages(rewards, cfg.group_size)
    order = torch.randperm(len(problems), generator=learner.generator).to(learner.device)
    totals = dict.fromkeys(_UPDATE_METRICS, 0.0)
    disagreements, tokens = 0.0, 0.0
    shape: dict[str, float] = {}
    for i, rows in enumerate(order.tensor_split(cfg.minibatches)):
        mini = batch.select(rows)
        n_tokens = float(learner.task.response_mask(mini.sampled_ids).sum())
        metrics = learner.update(mini, advantages[rows], cfg, shape=i == 0)
        # the policy's shape on the first mini-batch, before the step's first update: a random 1/minibatches
        # of the rollout (all of it costs a log-softmax and a top-K over every token's vocabulary again)
        shape = shape or {f"train/{name}": metrics[name] for name in ("entropy", "topk_mass", "rollout_probs_diff_mean")}
        for name in _UPDATE_METRICS:
            totals[name] += metrics[name] * n_tokens
        disagreements += metrics["disagreement_count"]
        tokens += n_tokens
    return {
        "train/reward": float(rewards.mean()),
        "train/response_length": float(learner.task.response_lengths(batch.sampled_ids).float().mean()),
        **{f"train/{name}": total / tokens for name, total in totals.items()},
        "train/disagreement_count": disagreements,
        **shape,
    }


def evaluate(learner: Learner, cfg: ToyConfig, step: int, tracker: Tracker) -> dict[str, float]:
    """avg@`eval_samples` on each held-out set at temperature 1.0, from the rollout engine."""
    learner.engine.sync(learner.policy)
    generator = torch.Generator().manual_seed(_eval_seed(cfg.seed, step))
    scores: dict[str, float] = {}
    for name in learner.task.eval_sets:
        problems = learner.task.heldout(name).repeat(cfg.eval_samples).to(learner.device)
        rollout = learner.engine.generate(problems.prompts, generator)
        correct = learner.task.score(problems, rollout.sampled_ids).view(-1, cfg.eval_samples)
        per_problem = correct.mean(1)
        answers = learner.task.answer_ids(rollout.sampled_ids).view(-1, cfg.eval_samples)
        tracker.log_per_problem(name, step, per_problem.tolist(), correct=correct.long().tolist(),
                                answers=answers.tolist())  # per sample: pass@k and maj@k (report)
        scores[f"eval/{name}"] = float(per_problem.mean())
    tracker.log_metrics(scores, step)
    return scores


def train(
    cfg: ToyConfig,
    workdir: Path,
    tracker: Tracker,
    *,
    stop_after: int | None = None,
    device: torch.device | str | None = None,
) -> dict[str, float]:
    """Train (resuming from workdir/checkpoints when a checkpoint is there); the final metrics.
    `device`: where to train (None: CPU)."""
    checkpoints = Path(workdir) / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    learner = Learner.from_base(cfg, device)
    start = 0
    loaded = load_latest_checkpoint(checkpoints, tracker)
    if loaded is not None:
        path, state = loaded
        _check_same_run(cfg, state["config"], path)
        start = learner.load_state_dict(state)
        print(f"pdmctl: resuming from {path.name} (step {start})", flush=True)
    final: dict[str, float] = {}
    if start == 0:
        final.update(evaluate(learner, cfg, 0, tracker))
    timed = preflight.requeue_at(Path(workdir)) is not None  # a preflight run's times (never in a result)
    broken = testhooks.breaks(BREAK_ENV, cfg.method) if start == 0 else {}
    for step in range(start + 1, cfg.steps + 1):
        began = time.monotonic()
        if step == start + 1:
            testhooks.break_at_first_forward(broken)
        metrics = train_step(learner, cfg)
        tracker.log_metrics(metrics, step)
        if timed:
            tracker.log_metrics(preflight.timings(time.monotonic() - began, first=step == start + 1), step)
        final.update(metrics)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            final.update(evaluate(learner, cfg, step, tracker))
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            save_checkpoint(checkpoints, learner.state_dict(step, cfg), step)
            if "plant" in broken:  # every checkpoint this attempt wrote, planted: its resume must refuse them
                for path in checkpoints.glob("step_*.pt"):
                    testhooks.plant_checkpoint(path, Path(workdir) / "planted-code-ran")
            testhooks.fail_if_asked(step, start == 0, FAIL_ENV)
            testhooks.lose_node_if_asked(step, start == 0, LOSE_NODE_ENV)
            preflight.requeue_if_asked(step, start == 0, Path(workdir))  # a preflight run's requeue
        # a test's hold (pdmctl.testhooks) at the end of a step: a time limit or a lost node finds the run mid-training
        testhooks.hold_if_asked(step, start == 0, HOLD_ENV, HOLD_S_ENV)
        wayout.checkpoint_and_requeue_if_asked(  # signalled before a time limit: this step saved, then requeued
            step, lambda s=step: save_checkpoint(checkpoints, learner.state_dict(s, cfg), s))
        if stop_after is not None and step >= stop_after:
            break
    return final


def _eval_seed(seed: int, step: int) -> int:
    digest = hashlib.sha256(f"eval/{seed}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # manual_seed takes 63 bits


def save_checkpoint(directory: Path, state: Mapping[str, object], step: int) -> None:
    """Write atomically, then drop all but the newest KEEP_CHECKPOINTS: a damaged newest one (a disk
    fault, a copy cut short) still leaves one to resume from."""
    path = directory / f"step_{step:08d}.pt"
    save_atomically(state, path)
    for old in sorted(directory.glob("step_*.pt"))[:-KEEP_CHECKPOINTS]:
        old.unlink(missing_ok=True)


def load_latest_checkpoint(directory: Path, tracker: Tracker) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads, and its state; each one skipped is said in the log and to the
    tracker (`pdmctl status` shows it). None when there is none; ValueError when none loads.

    Loaded with `weights_only=True`: a checkpoint holds tensors, dicts and plain values only, so a file
    planted in a shared run directory (a pickle that would run code) does not load and is skipped."""
    found = sorted(directory.glob("step_*.pt"), reverse=True)
    skipped = []
    for path in found:
        try:
            state = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as exc:  # torch raises RuntimeError, EOFError, UnpicklingError, ... for damage
            skipped.append(f"{path.name} does not load ({str(exc).strip().splitlines()[0][:120]})")
            continue
        if skipped:
            tracker.notice(f"resumed from {path.name}: " + "; ".join(skipped))
        return path, state
    if skipped:
        raise ValueError(f"{directory}: no checkpoint loads: " + "; ".join(skipped))
    return None


def _check_same_run(cfg: ToyConfig, saved: Mapping[str, object], path: Path) -> None:
    """A checkpoint resumes only the run that wrote it; `steps` may grow (a longer run continues)."""
    current = dataclasses.asdict(cfg)
    saved = {"data": "toy", **saved}  # a checkpoint from before the field: the model's own task
    changed = sorted(name for name in current if name != "steps" and saved.get(name) != current[name])
    if changed:
        raise ValueError(
            f"{path}: written by a run with a different {changed[0]} ({saved.get(changed[0])!r})"
        )
