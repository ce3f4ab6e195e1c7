"""One of VeRL's actor updates replayed offline from its snapshot (pdmctl.backends.verl.snapshot).

The model is the run's own Hugging Face causal LM (`AutoModelForCausalLM` from the run's model directory)
with the snapshot's weights. The loss is the actor's: `masks.token_diagnostics` on the response tokens'
logits divided by the temperature, `masks.token_loss`, summed and divided by the mini-batch's token count
(VeRL's token-mean over the global batch). The update is VeRL's: `clip_grad_norm_` at its clip_grad, then
the snapshot's optimizer (AdamW with its lr, betas, eps, weight decay) from its carried state.

Precisions: `float32` and `float64` compute everything in that type, each sequence on its own. `bf16` is
the actor's mixed precision, computed as VeRL computes it where the snapshot recorded VeRL's packed
micro-batches: each micro-batch one forward over its sequences end to end (positions restarting at 0) on
the weights cast to bfloat16 for that forward (so the micro-batches' gradients meet in float32, as FSDP's
do), the logits divided by the temperature in bfloat16, the log-probs by a log-softmax in bfloat16 (VeRL's
`logprobs_from_logits` without flash-attn's cross-entropy; with it, in float32) and the loss in float32.
On CPU that gives VeRL's own gradients bit for bit. Without that record, each sequence runs on its own in
bfloat16, and the gradients agree with VeRL's to bf16 precision only.

`check_replay` applies the clip and AdamW to VeRL's own gradients (recorded in the snapshot), which checks
the optimizer replay, and the replay's whole update (its own forward, every token as the run's mask
decides) beside it: both against VeRL's weights after the step, at float32 rounding's reach.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdmctl import masks

PRECISIONS = {"bf16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
FLOAT32_EPS = float(torch.finfo(torch.float32).eps)


class SnapshotError(ValueError):
    """A run directory or snapshot the replay cannot read (the CLI prints it as one line)."""


def snapshot_paths(run_dir: Path, step: int) -> list[Path]:
    directory = Path(run_dir) / "snapshots" / f"step-{step}"
    found = sorted(directory.glob("minibatch-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    if not found:
        where = Path(run_dir) / "snapshots"
        have = sorted(p.name for p in where.glob("step-*")) if where.is_dir() else []
        raise SnapshotError(
            f"{directory}: no snapshot of step {step} (have: {', '.join(have) or 'none'}); run with "
            f"PDMCTL_VERL_SNAPSHOT_STEP={step} to write one"
        )
    return found


def load_snapshot(path: Path) -> dict[str, Any]:
    import zipfile

    if path.is_file() and not zipfile.is_zipfile(path):  # torch.save writes a zip archive; an older format or junk
        raise SnapshotError(f"{path}: not a snapshot (not a file torch.save writes)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        said = (str(exc).splitlines() or [""])[0][:160]
        raise SnapshotError(f"{path}: not a snapshot ({type(exc).__name__}{': ' + said if said else ''})") from None


@dataclass(frozen=True)
class Sample:
    """One sequence of the mini-batch: its unpadded tokens and its response tokens' mask inputs."""

    input_ids: torch.Tensor  # [L]
    rows: torch.Tensor  # [T]: the logits row predicting each response token
    sampled_ids: torch.Tensor  # [T]
    topk_ids: torch.Tensor  # [T, K+1] (TopK ∪ {k})
    topk_logprobs: torch.Tensor  # [T, K+1]
    sampled_logprobs: torch.Tensor  # [T]
    advantages: torch.Tensor  # [T]


def samples_of(snapshot: dict[str, Any]) -> list[Sample]:
    from pdmctl.backends.verl.topk import sampled_slot

    b = snapshot["batch"]
    found = []
    for i, ids in enumerate(b["input_ids"]):
        mask = b["response_mask"][i].bool()
        width = mask.shape[0]
        attended = int(b["attention_mask"][i][-width:].sum()) if "attention_mask" in b else int(mask.sum())
        start = ids.shape[0] - attended  # the first response token's index in the unpadded sequence
        positions = mask.nonzero().squeeze(1)
        sampled = ids[start + positions].long()
        if "responses" in b and not torch.equal(b["responses"][i][positions].long(), sampled):
            raise SnapshotError(f"sample {i}: the response ids do not line up with the input ids")
        carried = b["topk_ids"][i]
        k = carried.shape[-1]
        held = positions < carried.shape[0]
        at = positions.clamp(max=max(carried.shape[0] - 1, 0))
        top_ids = torch.where(held[:, None], carried[at].long(), torch.zeros(len(at), k, dtype=torch.long))
        top_lp = torch.where(held[:, None], b["topk_logprobs"][i][at].float(), torch.full((len(at), k), -math.inf))
        sampled_lp = b["rollout_log_probs"][i][positions].float()
        slot_ids, slot_lp = sampled_slot(top_ids, top_lp, sampled, sampled_lp)
        found.append(Sample(
            input_ids=ids.long(), rows=start + positions - 1, sampled_ids=sampled,
            topk_ids=torch.cat([top_ids, slot_ids.masked_fill(~held, 0)[:, None]], -1),
            topk_logprobs=torch.cat([top_lp, slot_lp.masked_fill(~held, -math.inf)[:, None]], -1),
            sampled_logprobs=sampled_lp, advantages=b["advantages"][i][positions].float(),
        ))  # fmt: skip
    return found


def build_model(model_dir: str | Path) -> torch.nn.Module:
    """The run's causal LM from its directory's config (the weights come from the snapshot)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"{model_dir}: not a Hugging Face model directory ({str(exc).splitlines()[0][:160]})") from None
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()  # no dropout: the actor's update runs the model in train mode, but the tiny Qwen3 has none
    return model


class Replay:
    """The snapshot's update, replayable with any keep mask, in any of `PRECISIONS`."""

    def __init__(self, snapshot: dict[str, Any], model: torch.nn.Module) -> None:
        s = snapshot["settings"]
        if s.get("use_kl_loss") or s.get("entropy_coeff"):
            raise SnapshotError("the replay takes the policy loss alone: the run has a KL or an entropy term")
        if s["loss_agg_mode"] != "token-mean":
            raise SnapshotError(f"the replay takes token-mean aggregation, the run has {s['loss_agg_mode']!r}")
        self.snapshot, self.model, self.settings = snapshot, model, s
        self.mask = s["mask"]
        self.samples = samples_of(snapshot)
        self.names = [n for n, _ in model.named_parameters()]
        missing = [n for n in self.names if n not in snapshot["weights_before"]]
        if missing:
            raise SnapshotError(f"the model's parameters {missing[:3]} are not in the snapshot: another model directory?")
        opt = snapshot["optimizer"]
        if opt["class"] not in ("AdamW", "Adam") or len(opt["param_groups"]) != 1:
            raise SnapshotError(f"the replay takes one AdamW parameter group, the run has {opt['class']} "
                                f"with {len(opt['param_groups'])}")  # fmt: skip
        packed = snapshot.get("micro_batches")
        if packed is not None and sorted(i for group in packed for i in group) != list(range(len(self.samples))):
            raise SnapshotError(f"the snapshot's micro-batches {packed} do not hold its {len(self.samples)} samples once each")
        self.micro_batches: list[list[int]] | None = packed
        # VeRL's log-probs from bf16 logits: a log-softmax in bf16, or flash-attn's cross-entropy (float32 inside)
        self.bf16_log_softmax = s.get("log_probs_from", "log_softmax") == "log_softmax"
        self.group = opt["param_groups"][0]
        self.clip = float(opt["clip_grad"])
        self.scale = float(s["dp_size"]) / float(s["batch_num_tokens"])
        self.tokens = sum(len(x.sampled_ids) for x in self.samples)

    def weights(self, which: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        return {n: self.snapshot[which][n].to(dtype) for n in self.names}

    def logits(self, params: dict[str, torch.Tensor], precision: str) -> list[torch.Tensor]:
        """Each sample's response-token logits (float32 or float64, divided by the temperature)."""
        from torch.func import functional_call

        dtype = PRECISIONS[precision]
        if self.as_verl(precision):
            return self._packed_logits(params)
        used = {n: p.to(dtype) for n, p in params.items()}
        out_dtype = torch.float64 if precision == "float64" else torch.float32
        found = []
        for x in self.samples:
            z = functional_call(self.model, used, (x.input_ids[None],), {"use_cache": False}).logits[0, x.rows]
            found.append(z.to(out_dtype) / self.settings["temperature"])
        return found

    def as_verl(self, precision: str) -> bool:
        """Whether `precision` runs VeRL's own forwards: bf16 on a snapshot that recorded its micro-batches."""
        return precision == "bf16" and bool(self.micro_batches)

    def _packed_logits(self, params: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """VeRL's forwards (module doc): bf16 values, held in float32 (losslessly) for the diagnostics."""
        from torch.func import functional_call

        temperature = float(self.settings["temperature"])
        found: dict[int, torch.Tensor] = {}
        for group in self.micro_batches or []:
            used = {n: p.to(torch.bfloat16) for n, p in params.items()}  # cast per forward, as FSDP2 does
            ids = torch.cat([self.samples[i].input_ids for i in group])[None]
            positions = torch.cat([torch.arange(len(self.samples[i].input_ids)) for i in group])[None]
            z = functional_call(self.model, used, (ids,), {"position_ids": positions, "use_cache": False}).logits[0]
            if temperature != 1.0:  # VeRL divides in the logits' precision, by the temperature in it
                z = z / torch.tensor(temperature).clamp(min=1e-8).to(z.dtype)
            start = 0
            for i in group:
                found[i] = z[start + self.samples[i].rows].float()
                start += len(self.samples[i].input_ids)
        return [found[i] for i in range(len(self.samples))]

    def diagnostics(self, logits: list[torch.Tensor], method: str | None = None,
                    estimator: str | None = None) -> list[masks.Diagnostics]:  # fmt: skip
        m = self.mask
        with torch.no_grad():
            return [masks.token_diagnostics(
                z.detach(), x.sampled_ids, x.topk_ids, x.topk_logprobs.to(z.dtype), x.sampled_logprobs.to(z.dtype),
                x.advantages.to(z.dtype), method=method or m["method"], divergence=m["divergence"],
                estimator=estimator or m["estimator"], delta=m["delta"], delta_low=m["delta_low"],
                eps_low=m["eps_low"], eps_high=m["eps_high"], ratio_cap=m["ratio_cap"],
            ) for z, x in zip(logits, self.samples, strict=True)]  # fmt: skip

    def loss(self, logits: list[torch.Tensor], keep: list[torch.Tensor], precision: str = "float32") -> torch.Tensor:
        """The actor's loss with the keep masks `keep` (one bool [T] per sample)."""
        m = self.mask
        total = logits[0].new_zeros(())
        as_verl = self.as_verl(precision) and self.bf16_log_softmax
        for z, x, k, d in zip(logits, self.samples, keep, self.diagnostics(logits), strict=True):
            lsm = torch.log_softmax(z.to(torch.bfloat16), -1).float() if as_verl else torch.log_softmax(z, -1)
            log_prob = lsm.gather(-1, x.sampled_ids[:, None])[:, 0]
            token_loss = masks.token_loss(m["method"], log_prob, d.ratio.to(z.dtype), x.advantages.to(z.dtype), k,
                                          ratio_cap=m["ratio_cap"], eps_low=m["eps_low"], eps_high=m["eps_high"])  # fmt: skip
            total = total + token_loss.sum()
        return total * self.scale

    def gradient(self, keep: list[torch.Tensor], precision: str) -> dict[str, torch.Tensor]:
        """The raw gradient of the loss with `keep`, on the start weights (float32, or float64)."""
        dtype = torch.float64 if precision == "float64" else torch.float32
        params = {n: p.clone().requires_grad_(True) for n, p in self.weights("weights_before", dtype).items()}
        grads = torch.autograd.grad(self.loss(self.logits(params, precision), keep, precision), list(params.values()),
                                    allow_unused=True)  # fmt: skip
        return {n: (g if g is not None else torch.zeros_like(params[n])).detach() for n, g in zip(params, grads, strict=True)}

    def step(self, grads: dict[str, torch.Tensor], clip_factor: float | None = None) -> tuple[dict[str, torch.Tensor], float]:
        """VeRL's optimizer step on `grads` from the snapshot's weights and optimizer state: clip_grad_norm_ at
        clip_grad (or the gradients scaled by `clip_factor`), then the optimizer. Returns (weights, norm)."""
        dtype = next(iter(grads.values())).dtype
        params = [torch.nn.Parameter(self.snapshot["weights_before"][n].to(dtype).clone()) for n in self.names]
        for p, n in zip(params, self.names, strict=True):
            p.grad = grads[n].clone()
        if clip_factor is None:
            norm = float(torch.nn.utils.clip_grad_norm_(params, self.clip))
        else:
            norm = math.nan
            for p in params:
                p.grad.mul_(clip_factor)
        g = self.group
        cls = torch.optim.AdamW if self.snapshot["optimizer"]["class"] == "AdamW" else torch.optim.Adam
        optimizer = cls(params, lr=g["lr"], betas=tuple(g["betas"]), eps=g["eps"], weight_decay=g["weight_decay"],
                        amsgrad=bool(g.get("amsgrad", False)), foreach=False)  # fmt: skip
        state = self.snapshot["optimizer"]["state"]
        for p, n in zip(params, self.names, strict=True):
            if state.get(n):
                optimizer.state[p] = {k: (v.to(dtype).clone() if k != "step" else v.clone().float())
                                      for k, v in state[n].items()}  # fmt: skip
        optimizer.step()
        return {n: p.detach() for n, p in zip(self.names, params, strict=True)}, norm

    def clip_factor(self, grads: dict[str, torch.Tensor]) -> float:
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])))
        return min(1.0, self.clip / (norm + 1e-6))

    def divergence(self, params: dict[str, torch.Tensor], precision: str) -> torch.Tensor:
        """D of every response token (flat, samples in order) at the weights `params`."""
        div = masks.DIVERGENCES[self.mask["divergence"]]
        found = []
        with torch.no_grad():
            for z, x in zip(self.logits(params, precision), self.samples, strict=True):
                s, _ = masks.token_support(z, x.sampled_ids, x.topk_ids, x.topk_logprobs.to(z.dtype),
                                           x.sampled_logprobs.to(z.dtype), div.support, need_tail_sum_sq=False)  # fmt: skip
                found.append(div.family.divergence(s).double())
        return torch.cat(found)


@dataclass(frozen=True)
class ReplayCheck:
    """How the replay of the run's own update compares with VeRL's (max abs differences over the weights)."""

    optimizer_diff: float  # VeRL's gradients through the replay's clip and AdamW, against VeRL's weights after
    bound: float  # float32 rounding's reach on that: a few ulps of the largest weight
    grad_rel_diff: float  # the replay's own gradient (its forward in the actor's precision) against VeRL's
    full_diff: float  # the replay's own update against VeRL's weights after
    step_size: float  # the largest |change| VeRL's update made (the scale full_diff is read against)
    grad_norm_verl: float
    grad_norm_replay: float
    flipped: int  # tokens whose keep a float32 forward decides otherwise than the actor's precision's
    micro_batches: int = 0  # VeRL's packed forwards the replay ran as VeRL did (0: each sequence alone)


def _max_abs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n].detach().double() - b[n].detach().double()).abs().max()) for n in a)


ULPS = 4  # float32 rounding's reach on one AdamW step: a handful of ulps of the weight (the step's own ops)


def run_keep(replay: Replay, precision: str) -> list[torch.Tensor]:
    """The run's own mask on the snapshot's batch, from a forward at the start weights in `precision`."""
    return [d.keep.bool() for d in replay.diagnostics(replay.logits(replay.weights("weights_before"), precision))]


def check_replay(replay: Replay, precision: str = "bf16") -> ReplayCheck:
    """The replay of the run's own update against VeRL's (see the module doc)."""
    keep = run_keep(replay, precision)
    after = replay.weights("weights_after")
    before = replay.weights("weights_before")
    verl_grads = {n: replay.snapshot["grads"][n].float() for n in replay.names}
    from_verl, norm_verl = replay.step(verl_grads)
    largest = max(float(w.abs().max()) for w in after.values())
    own = replay.gradient(keep, precision)
    mine, norm_mine = replay.step(own)
    gdiff = torch.cat([(own[n] - verl_grads[n]).reshape(-1) for n in replay.names])
    gall = torch.cat([verl_grads[n].reshape(-1) for n in replay.names])
    flipped = sum(int((a != b).sum()) for a, b in zip(keep, run_keep(replay, "float32"), strict=True))
    return ReplayCheck(
        optimizer_diff=_max_abs(from_verl, after), bound=ULPS * FLOAT32_EPS * largest,
        grad_rel_diff=float(gdiff.norm() / gall.norm().clamp_min(1e-30)), full_diff=_max_abs(mine, after),
        step_size=_max_abs(before, after), grad_norm_verl=norm_verl, grad_norm_replay=norm_mine, flipped=flipped,
        micro_batches=len(replay.micro_batches or []) if replay.as_verl(precision) else 0,
    )  # fmt: skip
