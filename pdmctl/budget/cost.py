"""What a run, a setting and a sweep are expected to cost: GPU-hours (VeRL) or CPU-hours (the testbed), an
expected figure with a low-high range from stated assumptions, and the upper bound beside it.

VeRL (docs/CLUSTER.md, "Cost"). The expected cost takes a mean response length and the profile's tokens per
second per GPU (`throughput:`, derived at that length), each rate times a stated factor:

    mean response      = response_fraction x max_response_length
    rollout of a step  = batch x n x mean / (rollout rate x GPUs)                     (the bulk, at full batch)
                         + (tail_fraction x max_response_length - mean) / tail_decode  (the straggler tail: the
                                                                        slowest response decodes alone at the end)
    training of a step = batch x n x mean / (train rate x GPUs)      (the update's forward and backward)
                         x (1 + log_prob_share)   where the command recomputes the old log-probs (no
                                                  algorithm.rollout_correction.bypass_mode=true): one more forward
    fixed, per step    = step_fixed_s (weight sync to vLLM, offload and reload, vLLM's wake and sleep)
    one validation     = held-out problems x val_kwargs.n x mean / (rollout rate x GPUs) + the same tail
    checkpoint writes  = saves x checkpoint bytes / write_gb_s
    start-up           = startup_s per attempt (Ray, weights, vLLM and the trainer up; a resume's load),
                         attempts = the run's time over the profile's `time` per attempt
    each requeue       = with a save on the way out (the profile's save_grace_s, pdmctl.wayout): that
                         checkpoint's write, no step redone; without: save_freq / 2 steps redone on average

The assumptions are per model (`ASSUMPTIONS`): an expected value and a low-high range each; the low end of
the cost takes every one at its cheap end, the high end every one at its dear end. The upper bound takes every
response at its cap and every other assumption at its dear end. Until runs have been measured on the cluster
they are assumptions, not measurements, and the estimate says so (`RESTS_ON`); a setting that its preflight
measured is costed from the measured steps instead (`measured_verl_estimate`), which take precedence.

The testbed (its rates in TOY_ROLLOUT_S, TOY_STARTUP_S): a run's rollouts (steps x prompts_per_step x group_size) at a stated CPU time per rollout (the
default toy-small run: 40 steps of 1,024 rollouts in about 9 s of one core on a quiet machine, 32 s under
load; docs/TESTBED.md), evaluations included, plus a start-up per attempt; one CPU a job.

The sweep's wall time places the runs, in array order, on `max_concurrent` slots (each run starts when a
slot frees), for the expected, low, high and upper-bound run times alike. `pdmctl.budget.costing` applies the model
to a sweep (through the backends), calibrates it on finished runs and sets it against the hours spent.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Span:
    """An assumption or an estimate: its expected value and a low-high range around it."""

    expected: float
    low: float
    high: float

    def scaled(self, factor: float) -> Span:
        return Span(self.expected * factor, self.low * factor, self.high * factor)


@dataclass(frozen=True)
class Assumptions:
    """A model's stated assumptions for the expected cost of its VeRL runs (each: expected, low, high; for the
    rates and write_gb_s the low end is the cheap one, the larger value)."""

    response_fraction: Span  # the mean response's length as a share of max_response_length
    tail_fraction: Span  # the slowest response of a step (or a validation), as a share of max_response_length
    tail_decode: Span  # tokens per second one sequence decodes at once the batch has drained (the tail)
    startup_s: Span  # seconds from a job's start to its first step, per attempt (resume's load included)
    write_gb_s: Span  # GB per second a run writes its checkpoint to the shared filesystem
    step_fixed_s: Span  # seconds a step spends beyond its tokens: weight sync, offload and reload, vLLM wake/sleep
    rollout_rate: Span  # a factor on the profile's rollout rate (its uncertainty)
    train_rate: Span  # a factor on the profile's train rate
    log_prob_share: float = 1 / 3  # an old-log-prob forward, as a share of the update's forward and backward

    def dear_end(self) -> str:
        """What the high end of the range takes, in words: every assumption at its dear end."""
        r, t, d, s, w = self.response_fraction, self.tail_fraction, self.tail_decode, self.startup_s, self.write_gb_s
        return (f"responses {r.high:.0%} of the cap on average, the slowest at {t.high:.0%} decoding alone at "
                f"{d.high:g} tokens/s, the profile's rates x {self.rollout_rate.high:g} and x "
                f"{self.train_rate.high:g}, {self.step_fixed_s.high:g} s fixed a step, {s.high / 60:g} min start-ups, "
                f"writes at {w.high:g} GB/s")  # fmt: skip

    def describe(self) -> str:
        r, t, d, s, w = self.response_fraction, self.tail_fraction, self.tail_decode, self.startup_s, self.write_gb_s
        f, ro, tr = self.step_fixed_s, self.rollout_rate, self.train_rate
        return (f"mean response {r.expected:.0%} of the cap ({r.low:.0%}-{r.high:.0%}), slowest {t.expected:.0%} "
                f"({t.low:.0%}-{t.high:.0%}) decoding alone at {d.expected:g} tokens/s ({min(d.low, d.high):g}-"
                f"{max(d.low, d.high):g}), the profile's rollout rate x {ro.expected:g} ({_spread(ro)}) and train "
                f"rate x {tr.expected:g} ({_spread(tr)}), {f.expected:g} s fixed a step "
                f"({f.low:g}-{f.high:g}: weight sync, offload and reload, vLLM wake and sleep), start-up "
                f"{s.expected / 60:g} min an attempt ({s.low / 60:g}-{s.high / 60:g}), checkpoints written at "
                f"{w.expected:g} GB/s ({min(w.low, w.high):g}-{max(w.low, w.high):g})")  # fmt: skip


def _spread(span: Span) -> str:
    return f"{min(span.low, span.high):g}-{max(span.low, span.high):g}"


_DENSE = dict(tail_fraction=Span(1.0, 0.75, 1.0), startup_s=Span(600, 300, 1200), write_gb_s=Span(2.0, 5.0, 0.5),
              tail_decode=Span(150, 250, 80), rollout_rate=Span(1.0, 1.3, 0.5), train_rate=Span(1.0, 1.3, 0.7))
# Mean lengths: DAPO-style training of a Qwen3 base model averages about a third of an 8k cap (dense) and under a
# quarter of a 16k cap (30B-A3B); some responses reach the cap in nearly every step, so the slowest is the cap.
# Tail decode: about a third of one sequence's bandwidth bound on an H20 (4.0 TB/s over the 7.6-8.2 GB a GPU
# reads per token: each model's share of its rollout weights), for the per-iteration latencies.
# Rate factors: the profile's rates are derived from FLOPs and bandwidth at an assumed efficiency (docs/CLUSTER.md,
# "Cost"); the factors span the efficiencies' ranges, and further down, where systems fall short of them.
# Fixed a step: the weight sync from Megatron to vLLM (and FP8 quantisation for the 30B rollout), the
# parameters, gradients and optimizer offloaded and reloaded over PCIe, vLLM's wake (KV cache reallocated) and
# sleep, the reward and advantage on the CPU; estimates, not measured.
# For write_gb_s and the rates the "low" cost is the fast end: the low and high ends are of the cost, not the value.
# The old-log-prob forward: a third of the update's forward and backward; a quarter for 30B-A3B, whose update
# recomputes every layer's activations (a forward, a recomputed forward and a backward of two).
# Qwen3-0.6B on one GPU (clusters/one-gpu.yaml; not a paper model): the dense models' lengths; its weights fit a
# GPU with room, so a step's fixed time is the weight sync inside one GPU and vLLM's wake and sleep (no offload)
# and a start-up loads 1.2 GB; a lone sequence decodes at about 400 tokens/s (the iteration's fixed 1.5 ms and
# its 0.5 ms of weights), 200-550.
ASSUMPTIONS: dict[str, Assumptions] = {
    "qwen3-0.6b-base": Assumptions(Span(0.33, 0.2, 0.6), Span(1.0, 0.75, 1.0), tail_decode=Span(400, 550, 200),
                                   startup_s=Span(300, 150, 600), write_gb_s=Span(2.0, 5.0, 0.5),
                                   step_fixed_s=Span(10, 5, 20), rollout_rate=Span(1.0, 1.3, 0.5),
                                   train_rate=Span(1.0, 1.3, 0.7)),
    "qwen3-4b-base": Assumptions(Span(0.33, 0.2, 0.6), step_fixed_s=Span(30, 15, 60), **_DENSE),
    "qwen3-8b-base": Assumptions(Span(0.33, 0.2, 0.6), step_fixed_s=Span(40, 20, 80), **_DENSE),
    "qwen3-30b-a3b-base": Assumptions(Span(0.23, 0.12, 0.5), Span(1.0, 0.75, 1.0), tail_decode=Span(150, 250, 80),
                                      startup_s=Span(1200, 600, 2400), write_gb_s=Span(2.0, 5.0, 0.5),
                                      step_fixed_s=Span(90, 45, 180), rollout_rate=Span(1.0, 1.3, 0.5),
                                      train_rate=Span(1.0, 1.5, 0.6), log_prob_share=1 / 4),
}
RESTS_ON = "the stated assumptions (pdmctl/budget/cost.py; docs/CLUSTER.md, \"Cost\"), not measurements"

# The testbed: CPU seconds per rollout (evaluations included) and start-up, per attempt (expected, low, high)
TOY_ROLLOUT_S = Span(9.0 / 40_960, 6.0 / 40_960, 32.0 / 40_960)
TOY_STARTUP_S = Span(5.0, 3.0, 15.0)
TOY_DEAR_END = "a loaded machine's rate (the default toy-small run in 32 s of one core) and 15 s start-ups"
HIGH = "every stated assumption at its dear end"  # what a total's high end takes where its runs' words differ
AT_CAP = "every response at its cap, the rest as at the high end"  # what a VeRL run's upper bound takes
TOY_ASSUMPTIONS = ("the default toy-small run's 40 steps of 1,024 rollouts in 9 s of one core (6-32 s), start-up "
                   "5 s an attempt (3-15)")  # fmt: skip


@dataclass(frozen=True)
class Estimate:
    """One run's expected cost: wall seconds (expected, low, high) and the upper bound, on `devices` GPUs or
    CPUs held for all of it, in `attempts` attempts."""

    unit: str  # "GPU" or "CPU"
    devices: int
    seconds: Span
    upper_s: float
    attempts: int
    rests_on: str  # what the estimate rests on: RESTS_ON (assumptions) or the runs it was calibrated on
    assumptions: str = ""  # the values it took, in words
    parts: Mapping[str, float] = field(default_factory=dict)  # expected seconds by part (rollout, train, ...)
    high_assumes: str = HIGH  # what the range's high end takes, in words
    upper_assumes: str = ""  # what the upper bound takes, in words ("": it is the high end)

    @property
    def hours(self) -> Span:
        return self.seconds.scaled(self.devices / 3600)

    @property
    def upper_hours(self) -> float:
        return self.upper_s * self.devices / 3600

    def as_json(self) -> dict[str, Any]:
        h, w = self.hours, self.seconds
        return {"unit": f"{self.unit}-hours", "devices": self.devices, "device": self.unit,
                "expected": _r(h.expected), "low": _r(h.low), "high": _r(h.high), "upper_bound": _r(self.upper_hours),
                "wall_s": {"expected": _r(w.expected), "low": _r(w.low), "high": _r(w.high),
                           "upper_bound": _r(self.upper_s)},
                "attempts": self.attempts, "parts_s": {k: _r(v) for k, v in self.parts.items()},
                "rests_on": self.rests_on, "assumptions": self.assumptions, "high_assumes": self.high_assumes,
                "upper_bound_assumes": self.upper_assumes or self.high_assumes}  # fmt: skip


@dataclass(frozen=True)
class VerlShape:
    """What one VeRL run's command says of its work (read off the command: describe.py)."""

    model: str
    steps: int
    validations: int
    batch: int
    group: int
    response: int  # max_response_length
    held_out: int  # problems x val_kwargs.n, per validation
    gpus: int
    checkpoint_bytes: int
    saves: int
    save_freq: int = 0  # trainer.save_freq: steps between checkpoints (what a requeue without a save redoes)
    log_prob_recompute: bool = False  # the old log-probs recomputed by a forward (no bypass_mode=true)


LOG_PROB_SHARE = 1 / 3  # the old-log-prob forward's share for a model without stated assumptions (its cost at the cap)
BYPASS = "algorithm.rollout_correction.bypass_mode"  # true: the old log-probs are the rollout's, none recomputed


def attempts_needed(work: float, per_requeue: float, startup: float, limit_s: float | None) -> int:
    """The fewest attempts of `limit_s` seconds that hold `work`, each attempt's start-up and each requeue's
    `per_requeue` (the steps it redoes, or its save on the way out); 1 without a limit."""
    if not limit_s or limit_s <= startup:
        return 1
    room = limit_s - startup
    if per_requeue >= room:  # a requeue that redoes an attempt's worth never ends: counted without its redo
        return max(1, math.ceil(work / room))
    return max(1, math.ceil((work - per_requeue) / (room - per_requeue)))


def saves_on_the_way_out(cluster: Mapping[str, Any]) -> bool:
    """Whether the profile gives the trainer a grace to checkpoint before a requeue (save_grace_s: pdmctl.wayout)."""
    return bool(cluster.get("save_grace_s"))


def verl_estimate(shape: VerlShape, rollout_rate: float, train_rate: float, cluster: Mapping[str, Any]) -> Estimate | None:
    """The expected cost of one VeRL run, or None where the model has no stated assumptions."""
    a = ASSUMPTIONS.get(shape.model)
    if a is None:
        return None
    limit_s = 60 * float(cluster["time"]) if cluster.get("time") else None
    way_out = saves_on_the_way_out(cluster)
    s = shape
    recompute = 1 + a.log_prob_share if s.log_prob_recompute else 1.0

    def run(end: str, at_cap: bool = False) -> tuple[float, int, dict]:
        def at(span: Span) -> float:
            return getattr(span, end)

        mean = (1.0 if at_cap else at(a.response_fraction)) * s.response
        decode = at(a.tail_decode)
        straggler = 0.0 if at_cap else max(0.0, at(a.tail_fraction) * s.response - mean) / decode
        rollout_gpus = rollout_rate * at(a.rollout_rate) * s.gpus
        rollout = s.batch * s.group * mean / rollout_gpus + straggler
        train = s.batch * s.group * mean / (train_rate * at(a.train_rate) * s.gpus) * recompute
        fixed = at(a.step_fixed_s)
        validation = s.held_out * mean / rollout_gpus + straggler
        write = s.checkpoint_bytes / (at(a.write_gb_s) * 1e9)
        work = s.steps * (rollout + train + fixed) + s.validations * validation + s.saves * write
        per_requeue = write if way_out else max(0, s.save_freq) / 2 * (rollout + train + fixed)
        startup = at(a.startup_s)
        attempts = attempts_needed(work, per_requeue, startup, limit_s)
        parts = {"rollout": s.steps * rollout, "train": s.steps * train, "step_fixed": s.steps * fixed,
                 "validation": s.validations * validation, "checkpoint_writes": s.saves * write,
                 "requeues": (attempts - 1) * per_requeue, "startup": attempts * startup}  # fmt: skip
        return work + (attempts - 1) * per_requeue + attempts * startup, attempts, parts

    upper, upper_attempts, _ = run("high", at_cap=True)  # every response at the cap: no tail beyond the batch
    expected, attempts, parts = run("expected")
    low, _, _ = run("low")
    high, high_attempts, _ = run("high")

    def requeues(n: int) -> str:
        return "" if not limit_s else f", {n - 1} requeue(s) ({duration(limit_s)} an attempt)"
    said = a.describe() + "; " + (
        f"old log-probs recomputed by a forward each step (+{a.log_prob_share:.0%} of the update: the command "
        f"has no {BYPASS}=true)" if s.log_prob_recompute else
        f"old log-probs the rollout's ({BYPASS}=true): no recompute forward") + (
        "" if not limit_s else "; a requeue saves on the way out (save_grace_s): no step redone" if way_out else
        f"; a requeue redoes {s.save_freq / 2:g} steps on average (save_freq {s.save_freq}, no save_grace_s)")  # fmt: skip
    return Estimate("GPU", s.gpus, Span(min(expected, upper), min(low, upper), min(high, upper)), upper, attempts,
                    RESTS_ON, said, parts, a.dear_end() + requeues(high_attempts),
                    AT_CAP + requeues(upper_attempts))  # fmt: skip


@dataclass(frozen=True)
class StepCalibration:
    """A VeRL setting's times measured by its preflight runs (`pdmctl preflight`): a training step (rollout,
    old log-probs and update), an attempt's start-up to its first step, a checkpoint's write."""

    step_s: Span
    startup_s: Span
    save_s: Span | None
    rests_on: str
    validation_s: Span | None = None  # a validation's seconds (VeRL's timing_s/testing)


def measured_verl_estimate(shape: VerlShape, stated: Estimate | None, measured: StepCalibration,
                           cluster: Mapping[str, Any]) -> Estimate:
    """One VeRL run's cost from what its setting's preflight measured: its steps, start-ups, checkpoint writes
    and validations at the measured times, in place of the stated rates, fixed time and recompute (the measured
    step holds them all). The preflight measures a run's first steps, whose responses are the shortest of the
    run: where the stated model (`stated`) has an estimate, its high end and upper bound stay."""
    limit_s = 60 * float(cluster["time"]) if cluster.get("time") else None
    if measured.validation_s is not None:
        validation = shape.validations * measured.validation_s.expected
    else:
        validation = stated.parts.get("validation", 0.0) if stated is not None else 0.0
    if measured.save_s is not None:
        save = measured.save_s.expected
    elif stated is not None and shape.saves:
        save = stated.parts.get("checkpoint_writes", 0.0) / shape.saves
    else:
        save = 0.0
    way_out = saves_on_the_way_out(cluster)

    def total(step: float, startup: float) -> tuple[float, int, float]:
        work = shape.steps * step + validation + shape.saves * save
        per_requeue = save if way_out else max(0, shape.save_freq) / 2 * step
        attempts = attempts_needed(work, per_requeue, startup, limit_s)
        return work + (attempts - 1) * per_requeue + attempts * startup, attempts, (attempts - 1) * per_requeue

    expected, attempts, requeues = total(measured.step_s.expected, measured.startup_s.expected)
    low, _, _ = total(measured.step_s.low, measured.startup_s.low)
    high, _, _ = total(measured.step_s.high, measured.startup_s.high)
    high = max(high, stated.seconds.high) if stated is not None else high
    upper = max(stated.upper_s, high) if stated is not None else high
    s = measured.step_s
    said = (f"measured a step of {s.expected:.3g} s ({s.low:.3g}-{s.high:.3g}) and a start-up of "
            f"{measured.startup_s.expected:.3g} s an attempt on the preflight's first steps (these take precedence "
            "over the stated rates, fixed time and recompute)"
            + ("; the stated model's high end kept (later steps have longer responses)" if stated is not None
               else "; no stated model for this setting: the measured range alone"))  # fmt: skip
    parts = {"steps": shape.steps * s.expected, "validation": validation, "checkpoint_writes": shape.saves * save,
             "requeues": requeues, "startup": attempts * measured.startup_s.expected}  # fmt: skip
    slowest = "the slowest measured step and start-up"
    stated_high = stated is not None and stated.seconds.high >= high
    return Estimate("GPU", shape.gpus, Span(expected, min(low, expected), max(high, expected)), upper, attempts,
                    measured.rests_on, said, parts, stated.high_assumes if stated_high else slowest,
                    stated.upper_assumes if stated is not None and stated.upper_s >= high else "")  # fmt: skip


def toy_rollouts(flat: Mapping[str, Any]) -> int:
    return int(flat["steps"]) * int(flat["prompts_per_step"]) * int(flat["group_size"])


def toy_estimate(flat: Mapping[str, Any], cluster: Mapping[str, Any]) -> Estimate:
    """The expected cost of one testbed run, in CPU-hours (one CPU a job, or the profile's cpus_per_task): at
    the stated rates, or at the rate measured on finished runs of its setting (`cluster["calibration"]`,
    `calibrate`)."""
    rollouts = toy_rollouts(flat)
    cpus = int(cluster.get("cpus_per_task") or 1)
    measured = (cluster.get("calibration") or {}).get(f"toy: {flat['model']} {flat['precision']}")
    rate, startup, rests_on, assumptions = TOY_ROLLOUT_S, TOY_STARTUP_S, RESTS_ON, TOY_ASSUMPTIONS
    dear = TOY_DEAR_END
    if measured is not None:
        rate, startup, rests_on = measured.per_rollout_s, measured.startup_s, measured.rests_on
        dear = f"the slowest finished run's rate ({rate.high * 1e3:.3g} ms of one core a rollout), {startup.high:.3g} s start-up"
        assumptions = (f"measured {rate.expected * 1e3:.3g} ms of one core a rollout ({rate.low * 1e3:.3g}-"
                       f"{rate.high * 1e3:.3g}) and a start-up of {startup.expected:.3g} s ({measured.startup_basis})")
    work = rate.scaled(rollouts)
    seconds = Span(work.expected + startup.expected, work.low + startup.low, work.high + startup.high)
    return Estimate("CPU", cpus, seconds, seconds.high, 1, rests_on, assumptions,
                    {"training": work.expected, "startup": startup.expected}, dear)  # fmt: skip


@dataclass(frozen=True)
class Calibration:
    """A setting's rate measured on finished runs: seconds of one core per rollout (fitted, lowest, highest)
    and the start-up (fitted where the runs differ in length, else the stated one)."""

    per_rollout_s: Span
    startup_s: Span
    startup_basis: str
    rests_on: str


def wall_seconds(run_seconds: Sequence[float], slots: int | None, nodes: Sequence[int] | None = None,
                 slot_nodes: int = 1) -> float:
    """The runs, in array order, on `slots` slots (each starts when one frees): when the last one ends
    (`end_times`)."""
    return max(end_times(run_seconds, slots, nodes, slot_nodes), default=0.0)


def end_times(run_seconds: Sequence[float], slots: int | None, nodes: Sequence[int] | None = None,
              slot_nodes: int = 1) -> list[float]:
    """When each run ends (in the order given), the runs started in array order on `slots` slots (each starts
    when one frees). With `nodes` (each run's), a slot is `slot_nodes` nodes and a run of fewer shares one
    with others. The runs of one node count go out as one array, the arrays in the order their counts first
    come (executors.slurm), and the earlier array's runs start first: the runs take the nodes in that order,
    each starting once its count is free (no run overtakes one before it). Runs of one slot each give the
    same times as without."""
    ends = [0.0] * len(run_seconds)
    if not run_seconds:
        return ends
    if nodes is None or slots is None:
        free = [(0.0, i) for i in range(min(slots or len(run_seconds), len(run_seconds)))]
        for i, seconds in enumerate(run_seconds):
            start, slot = heapq.heappop(free)
            ends[i] = start + seconds
            heapq.heappush(free, (ends[i], slot))
        return ends
    counts = list(dict.fromkeys(nodes))
    placed = sorted(range(len(run_seconds)), key=lambda i: counts.index(nodes[i]))
    free, now, running = slots * slot_nodes, 0.0, []
    for i in placed:
        need = min(nodes[i], slots * slot_nodes)
        while free < need:  # the next run waits for the earliest ends
            now, given = heapq.heappop(running)
            free += given
        ends[i] = now + run_seconds[i]
        heapq.heappush(running, (ends[i], need))
        free -= need
    return ends


@dataclass(frozen=True)
class Total:
    """The cost of several runs (a setting's, the sweep's): hours summed, wall time on the slots."""

    runs: int
    unit: str
    hours: Span
    upper_hours: float
    wall_s: Span
    upper_wall_s: float
    high_assumes: str = HIGH  # what the high end takes: its runs' words where they agree
    upper_assumes: str = ""  # what the upper bound takes ("": it is the high end)


def total(estimates: Sequence[Estimate], slots: int | None, nodes: Sequence[int] | None = None,
          slot_nodes: int = 1) -> Total:
    """Hours summed; wall time on `slots` (`wall_seconds`: with each run's `nodes`, on slots of `slot_nodes`)."""
    units = {e.unit for e in estimates}
    hours = Span(sum(e.hours.expected for e in estimates), sum(e.hours.low for e in estimates),
                 sum(e.hours.high for e in estimates))  # fmt: skip
    wall = Span(*(wall_seconds([getattr(e.seconds, k) for e in estimates], slots, nodes, slot_nodes)
                  for k in ("expected", "low", "high")))  # fmt: skip
    highs = {e.high_assumes for e in estimates}
    uppers = {e.upper_assumes for e in estimates}
    return Total(len(estimates), "/".join(sorted(units)) or "GPU", hours, sum(e.upper_hours for e in estimates), wall,
                 wall_seconds([e.upper_s for e in estimates], slots, nodes, slot_nodes),
                 highs.pop() if len(highs) == 1 else HIGH,
                 uppers.pop() if len(uppers) == 1 else (AT_CAP if any(uppers) else ""))  # fmt: skip


def total_json(t: Total) -> dict[str, Any]:
    day = 86400
    return {"runs": t.runs, "unit": f"{t.unit}-hours", "expected": _r(t.hours.expected), "low": _r(t.hours.low),
            "high": _r(t.hours.high), "upper_bound": _r(t.upper_hours),
            "wall_days": {"expected": _r(t.wall_s.expected / day), "low": _r(t.wall_s.low / day),
                          "high": _r(t.wall_s.high / day), "upper_bound": _r(t.upper_wall_s / day)}}  # fmt: skip


def _r(x: float) -> float:
    """Four significant digits: what an estimate carries."""
    return float(f"{x:.4g}")


def hours_text(hours: Span, upper: float, unit: str = "GPU", high: str = HIGH, at_cap: str = "") -> str:
    """`79,000 GPU-hours expected (35,000-208,000; high: every stated assumption at its dear end), at the length
    cap 397,384 (every response at its cap, ...)`: each end named by what it takes. No length-cap figure where
    the upper bound is the high end (the testbed's)."""
    text = f"{number(hours.expected)} {unit}-hours expected ({number(hours.low)}-{number(hours.high)}; high: {high})"
    return text + (f", at the length cap {number(upper)} ({at_cap})" if at_cap else "")


def total_text(t: Total, unit: str | None = None) -> str:
    """`hours_text` of a total, each end named by what its runs' estimates take."""
    return hours_text(t.hours, t.upper_hours, unit or t.unit, t.high_assumes, t.upper_assumes)


def number(x: float) -> str:
    """An hours figure as printed: whole above 10 (three significant digits from 1e15), two decimals above 1,
    two significant digits below."""
    return f"{x:.3g}" if x >= 1e15 else f"{x:,.0f}" if x >= 10 else f"{x:.2f}" if x >= 1 else f"{x:.2g}"


def duration(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min"


# ---------------------------------------------------------------------------
# Spent against predicted (pdmctl status)
# ---------------------------------------------------------------------------


def spent_seconds(record: Any, now: float) -> float | None:
    """Wall seconds a run's attempts have taken: each attempt from its recorded start to the next attempt's
    start, the last to the run's end (now, while it runs); None where no attempt has started."""
    from datetime import datetime

    starts = []
    for attempt in record.attempts:
        try:
            starts.append(datetime.strptime(str(attempt["started"]), "%Y-%m-%dT%H:%M:%S%z").timestamp())
        except (KeyError, ValueError):
            continue
    if not starts:
        return None
    starts.sort()
    end = record.end_time / 1000 if record.end_time and record.status != "RUNNING" else now
    ends = [*starts[1:], max(end, starts[-1])]
    return sum(max(0.0, b - a) for a, b in zip(starts, ends, strict=True))
