"""The rollout top-K carry at the paper's scale.

One RL step of the paper's dense runs: 1,024 responses (128 prompts x n 8) of up to 8,192 tokens, K = 20.
Per generated token vLLM hands the server `{token_id: Logprob}` with the top-K and the sampled token;
pdmctl turns each response into `[T, K+1]` ids and log-probs (`topk.extract_topk`, in the vLLM server),
sends them to the agent-loop worker in the response's `extra_fields` (Ray pickles them), and pads the
batch into `[1024, 8192, K+1]` tensors (`topk.pad_topk`) that travel with the batch to the actor.

Timed, in one process on one thread, every response at the full 8,192 tokens (the worst case):

    extract (before)   the per-token Python loop of 49e0c0d (tests/topk_reference.py), on
                       --before-responses responses (it runs at a few thousand tokens/s: a full step
                       would take minutes; tokens/s is a rate, so a sample measures it)
    extract (dicts)    the vectorised `topk.extract_topk` on vLLM's {token_id: Logprob} dicts, every response
    extract (flat)     the same on vLLM's FlatLogprobs (`SamplingParams(flat_logprobs=True)`, which the
                       server patch asks for now): flat id / log-prob / rank lists read as arrays, every
                       response; what is carried now
    VeRL's read        VeRL's own `logprobs[token_id].logprob` per position (the sampled token's
                       rollout log-prob), on dicts and on FlatLogprobs, on the sample: on flat lists it
                       builds the dict that vLLM's output processor otherwise builds, so it moves a
                       cost rather than adding one (not part of the carry)
    hand-over          server -> agent-loop worker: `.tolist()` + pickle + `torch.as_tensor` (the lists
                       49e0c0d carried), against pickling the tensors themselves (carried until
                       2026-12-02) and numpy views of them with pickle protocol 5, as Ray sends them
                       (what is carried now: the buffers travel as bytes, no per-element work)
    pad                `topk.pad_topk` of the whole batch

The share of a rollout step: the carry's CPU seconds per token times the tokens per second one vLLM
server generates (--server-tokens-per-s; each server extracts its own responses while its GPU
generates, so the share does not depend on the number of servers). The default, 5,000 tokens/s, is an
estimate for Qwen3-4B on one H20 (TP 1) with 32 sequences at a time, memory-bound: 4.0 TB/s over 8 GB
of weights plus ~19 GB of KV cache per decode step, about 150 steps/s x 32; a faster server makes
the share larger. Counting the whole carry as if it stalled generation is an upper bound: the
engine core generates in another process meanwhile.

Memory: the carried tensors' bytes (per response, and the padded batch) and this process's peak RSS.
Inputs are a pool of --pool distinct responses used round-robin (1,024 distinct ones would be 176 M
Logprob objects, ~25 GB of Python objects, which no rollout holds at once either).

The carry at scale (`--sections carry`): what one RL step moves with the batch, before
(the padded layout until 634251f: `[bsz, longest response, K+1]` int64 ids + float32 log-probs, each
agent-loop worker's share padded by `pad_topk`) and after (`topk.carry_topk`: each response's own
`[T_i, K]`, int32 ids + float32 log-probs, in the DataProto's non_tensor_batch), at two scales:

    dense 4B    1,024 responses (128 prompts x n 8), every one at the 8,192-token limit (the worst case)
    MoE 30B     4,096 responses (256 x n 16) of up to 16,384 tokens, lengths log-normal (sigma 0.8,
                fixed seed) clipped at the limit, the median set so that the mean is 6,000 tokens

Each stage runs as VeRL 0.9.1 runs it, in this one process: the agent-loop workers (--agent-workers)
each lay out their share (`_postprocess`; timed), hand their DataProto to the driver (pickled with
protocol 5 and a buffer callback, as Ray sends it; the bytes in band and out of band are counted),
the driver concatenates the shares and balances the batch (`DataProto.concat`, `reorder`), converts it
(`to_tensordict`, `left_right_2_no_padding` does not touch the top-K) and sends one chunk per data-
parallel rank (--dp; `chunk_tensordict`, pickled the same way), and one rank reads its rows back for
the mask (`topk.carried_rows`; the padded layout: `padded[valid]`). Reported: the carried bytes (exact, from the
arrays), the seconds of each stage, and the process's peak memory above its baseline over the whole
carry (Linux's VmHWM, reset before each layout). The padded layout is 2.1 GB at 4B scale and 16.9 GB at
30B before any copy, and its path copies it several times (DataProto's torch.save, concat, a whole
storage pickled per rank): it does not fit beside the CI on a 24 GiB machine, so its size is computed,
and its time and peak are measured on --before-sample responses of the batch (times scaled to the
batch; what it prints says so). The new layout runs on the whole batch. The rollout
values are synthetic (the carry does not look at them, only checks them): ids uniform over Qwen3's
151,936, the sampled token outside the top-K at 10% of positions.

    python bench/topk.py [--sections extract,carry] [--responses 1024] [--tokens 8192] [--k 20]
                         [--before-responses 8] [--pool 4] [--agent-workers 8] [--dp 8] [--before-sample 256]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import pickle
import random
import resource
import sys
import time
import tracemalloc
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from topk_reference import (
    reference_check_alignment,
    reference_extract_topk,
    reference_pad_topk,
    vllm_flat_response,
)

from pdmctl.backends.verl import topk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--responses", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--before-responses", type=int, default=8)
    ap.add_argument("--pool", type=int, default=4)
    ap.add_argument("--server-tokens-per-s", type=float, default=5000.0)
    ap.add_argument("--sections", default="extract,carry", help="comma-separated: extract, carry")
    ap.add_argument("--agent-workers", type=int, default=8, help="VeRL's rollout.agent.num_workers")
    ap.add_argument("--dp", type=int, default=8, help="data-parallel ranks the driver sends chunks to")
    ap.add_argument("--before-sample", type=int, default=64, help="responses the padded layout is run on")
    ap.add_argument("--mean-tokens", type=int, default=6000, help="mean response length at 30B scale")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    if not sections or sections - {"extract", "carry"}:
        print(f"--sections: expected extract and/or carry, got {args.sections!r}", file=sys.stderr)
        sys.exit(2)
    if "extract" in sections:
        extraction(args)
    if "carry" in sections:
        carry_at_scale(args)


def extraction(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # a vLLM server's event loop is one thread
    k, tokens, n = args.k, args.tokens, args.responses

    t0 = time.perf_counter()
    rng = random.Random(0)
    flat_pool, pool = [], []  # vLLM's flat layout, and the {token_id: Logprob} dicts it stands for
    for _ in range(args.pool):
        ids, flat = vllm_flat_response(rng, tokens, k)
        flat_pool.append(flat)
        pool.append((ids, [flat[t] for t in range(len(flat))]))
    print(f"inputs: {args.pool} distinct responses of {tokens} tokens x K={k} (vLLM-shaped) in "
          f"{time.perf_counter() - t0:.1f} s; timing {n} responses = {n * tokens:,} tokens, one thread")  # fmt: skip

    gc.collect()
    before_s = 0.0
    for i in range(args.before_responses):
        ids, positions = pool[i % len(pool)]
        t0 = time.perf_counter()
        want = reference_extract_topk(ids, positions, k)
        before_s += time.perf_counter() - t0
        got = topk.extract_topk(ids, positions, k)
        assert torch.equal(got.ids, want.ids) and torch.equal(got.logprobs, want.logprobs)
    before_tokens = args.before_responses * tokens

    verl_dict_s = verl_flat_s = 0.0
    for i in range(args.before_responses):
        ids, positions = pool[i % len(pool)]
        for given in (positions, flat_pool[i % len(pool)]):
            t0 = time.perf_counter()
            [lp[ids[t]].logprob for t, lp in enumerate(given)]  # VeRL 0.9.1's vllm_async_server line
            elapsed = time.perf_counter() - t0
            if given is positions:
                verl_dict_s += elapsed
            else:
                verl_flat_s += elapsed

    supports = []
    dicts_s = after_s = list_s = tensor_s = array_s = 0.0
    for i in range(n):
        ids, positions = pool[i % len(pool)]
        t0 = time.perf_counter()
        on_dicts = topk.extract_topk(ids, positions, k)
        dicts_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        support = topk.extract_topk(ids, flat_pool[i % len(pool)], k)
        after_s += time.perf_counter() - t0
        if i < len(pool):
            assert torch.equal(on_dicts.ids, support.ids) and torch.equal(on_dicts.logprobs, support.logprobs)
        if i < args.before_responses:  # the hand-over both ways, on a sample as well
            t0 = time.perf_counter()
            wire = pickle.dumps({"ids": support.ids.tolist(), "logprobs": support.logprobs.tolist()})
            back = pickle.loads(wire)
            torch.as_tensor(back["ids"], dtype=torch.int64), torch.as_tensor(back["logprobs"])
            list_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        back = pickle.loads(pickle.dumps({"ids": support.ids, "logprobs": support.logprobs}))
        topk.RolloutTopK(torch.as_tensor(back["ids"]), torch.as_tensor(back["logprobs"]))
        tensor_s += time.perf_counter() - t0
        t0 = time.perf_counter()  # what the server hands over now: numpy views (Ray: pickle protocol 5)
        back = pickle.loads(pickle.dumps({"ids": support.ids.numpy(), "logprobs": support.logprobs.numpy()},
                                         protocol=5))  # fmt: skip
        support = topk.RolloutTopK(torch.as_tensor(back["ids"]), torch.as_tensor(back["logprobs"]))
        array_s += time.perf_counter() - t0
        supports.append(support)
    t0 = time.perf_counter()
    batch = reference_pad_topk(supports, tokens, k)
    pad_s = time.perf_counter() - t0
    del supports

    tracemalloc.start()
    as_lists = (batch.ids[0].tolist(), batch.logprobs[0].tolist())
    list_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del as_lists

    total = n * tokens
    rows = [
        ("extract, before (per-token loop)", before_tokens / before_s, before_s * total / before_tokens),
        ("extract, vectorised on dicts", total / dicts_s, dicts_s),
        ("extract, vectorised on flat (after)", total / after_s, after_s),
        ("hand-over as lists (before)", before_tokens / list_s, list_s * total / before_tokens),
        ("hand-over as tensors (2026-12-02)", total / tensor_s, tensor_s),
        ("hand-over as arrays (after)", total / array_s, array_s),
        ("pad the batch (until 634251f)", total / pad_s, pad_s),
    ]
    print(f"\n{'stage':36s} {'tokens/s':>12s} {'s per step':>11s}")
    for name, rate, seconds in rows:
        print(f"{name:36s} {rate:12,.0f} {seconds:11.1f}")
    carry_before = rows[0][2] + rows[3][2] + pad_s
    carry_dicts = dicts_s + array_s + pad_s
    carry_after = after_s + array_s + pad_s
    print(f"{'carry, before (loop + lists + pad)':36s} {total / carry_before:12,.0f} {carry_before:11.1f}")
    print(f"{'carry, dicts (vectorised + arrays)':36s} {total / carry_dicts:12,.0f} {carry_dicts:11.1f}")
    print(f"{'carry, after (flat + arrays + pad)':36s} {total / carry_after:12,.0f} {carry_after:11.1f}")
    print(
        f"speed-up: extraction {rows[2][1] / rows[0][1]:.1f}x (flat over dicts {rows[2][1] / rows[1][1]:.1f}x), "
        f"whole carry {carry_before / carry_after:.1f}x"
    )
    print(f"VeRL's sampled-token read (not carried): {before_tokens / verl_dict_s:,.0f} tokens/s on dicts, "
          f"{before_tokens / verl_flat_s:,.0f} on FlatLogprobs")  # fmt: skip

    per_response = (batch.ids[0].nbytes + batch.logprobs[0].nbytes) / 2**20
    carried = (batch.ids.nbytes + batch.logprobs.nbytes) / 2**30
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"\nthe padded layout (carried until 634251f; --sections carry for today's): {per_response:.2f} MiB per response ([{tokens}, {k + 1}] int64 ids + float32 "
          f"log-probs; as Python lists {list_bytes / 2**20:.1f} MiB), the padded batch "
          f"[{n}, {tokens}, {k + 1}] {carried:.2f} GiB; peak RSS of this process {peak_rss:.2f} GiB")  # fmt: skip

    rate = args.server_tokens_per_s
    for label, seconds in (("before", carry_before), ("dicts", carry_dicts), ("after", carry_after)):
        share = seconds / total * rate
        print(
            f"share of a rollout step at {rate:,.0f} generated tokens/s per vLLM server, {label}: {100 * share:.1f}%"
        )
    print(f"the carry stays under 2% up to {0.02 * total / carry_after:,.0f} generated tokens/s per server")

VOCAB = 151_936  # Qwen3's
GB, GIB = 1e9, 2**30


def _memory() -> tuple[int, int]:
    """(current, peak) resident bytes of this process (Linux /proc)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _reset_peak() -> int:
    """Reset the peak to the current resident size (`clear_refs` 5); returns that baseline."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _memory()[0]


def lengths_for(scale: str, n: int, cap: int, mean: int) -> np.ndarray:
    if scale == "4B":
        return np.full(n, cap, dtype=np.int64)  # the worst case: every response at the limit
    z = np.random.default_rng(0).standard_normal(n)
    lo, hi = 0.0, math.log(cap) + 5
    for _ in range(100):  # the log-median giving the mean wanted once clipped at the limit
        mid = (lo + hi) / 2
        clipped = np.minimum(cap, np.maximum(1, np.rint(np.exp(mid + 0.8 * z))))
        lo, hi = (mid, hi) if clipped.mean() < mean else (lo, mid)
    return np.minimum(cap, np.maximum(1, np.rint(np.exp(lo + 0.8 * z)))).astype(np.int64)


def synthetic_share(rng: np.random.Generator, lengths: np.ndarray, cap: int, k: int, id_dtype: Any):
    """One agent-loop worker's responses as the vLLM server hands them over: per response `[T, K+1]`
    ids (`id_dtype`) and float32 log-probs, slot K the sampled token where it is outside the top-K;
    and VeRL's own `responses`, `response_mask`, `rollout_log_probs` ([n, cap], right-padded)."""
    total = int(lengths.sum())
    ids = rng.integers(0, VOCAB - 1024, (total, k + 1), dtype=np.int64).astype(id_dtype)
    lps = -rng.standard_exponential((total, k + 1), dtype=np.float32)
    outside = rng.random(total) < 0.1
    slot = rng.integers(0, k, total)
    sampled = np.where(outside, rng.integers(VOCAB - 1024, VOCAB, total), ids[np.arange(total), slot])
    sampled_lp = np.where(outside, lps[:, k], lps[np.arange(total), slot])
    ids[:, k] = np.where(outside, sampled, 0)
    lps[:, k] = np.where(outside, lps[:, k], -np.inf)
    n = len(lengths)
    responses = torch.zeros(n, cap, dtype=torch.int64)
    rollout_lp = torch.zeros(n, cap, dtype=torch.float32)
    mask = torch.arange(cap)[None, :] < torch.from_numpy(lengths)[:, None]
    responses[mask] = torch.from_numpy(sampled)
    rollout_lp[mask] = torch.from_numpy(sampled_lp)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    supports = [topk.RolloutTopK(torch.from_numpy(ids[a:b]), torch.from_numpy(lps[a:b]))
                for a, b in pairwise(starts)]  # fmt: skip
    return supports, responses, mask.long(), rollout_lp


def _ray_pickle(obj: Any) -> tuple[Any, int, int, float]:
    """Pickle and unpickle `obj` as Ray does (protocol 5, buffers out of band): (copy, bytes in band,
    bytes out of band, seconds)."""
    t0 = time.process_time()
    buffers: list[pickle.PickleBuffer] = []
    wire = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    back = pickle.loads(wire, buffers=buffers)
    seconds = time.process_time() - t0
    return back, len(wire), sum(b.raw().nbytes for b in buffers), seconds


def run_layout(layout: str, lengths: np.ndarray, cap: int, k: int, workers: int, dp: int) -> dict[str, float]:
    """One step's carry in `layout` ("padded": until 634251f; "carried": now), stage by stage."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu

    out = dict.fromkeys(("layout", "to_driver", "concat", "to_ranks", "read"), 0.0)
    out["wire_in_band"] = out["wire_out_of_band"] = 0.0
    baseline = _reset_peak()
    rng = np.random.default_rng(1)
    shares, carried_bytes = [], 0
    for share in np.array_split(np.arange(len(lengths)), workers):
        share_lengths = lengths[share]
        id_dtype = np.int64 if layout == "padded" else np.int32  # what the server handed over
        supports, responses, mask, rollout_lp = synthetic_share(rng, share_lengths, cap, k, id_dtype)
        t0 = time.process_time()
        if layout == "padded":  # _postprocess until 634251f: pad the share to the batch's response length
            padded = reference_pad_topk(supports, cap, k)
            reference_check_alignment(padded, responses, mask)
            proto = DataProto.from_dict({topk.TOPK_IDS_KEY: padded.ids, topk.TOPK_LOGPROBS_KEY: padded.logprobs})
            del padded
        else:
            ids, lps = topk.carry_topk(supports, responses, mask, rollout_lp, k)
            proto = DataProto.from_dict({"rollout_log_probs": torch.zeros(len(share), 1)},
                                        non_tensors={topk.TOPK_IDS_KEY: ids, topk.TOPK_LOGPROBS_KEY: lps})  # fmt: skip
            del ids, lps
        out["layout"] += time.process_time() - t0
        del supports, responses, mask, rollout_lp
        proto, in_band, out_of_band, seconds = _ray_pickle(proto)  # agent-loop worker -> driver
        out["to_driver"] += seconds
        out["wire_in_band"] += in_band
        out["wire_out_of_band"] += out_of_band
        shares.append(proto)
    t0 = time.process_time()
    batch = DataProto.concat(shares)
    del shares, proto
    batch.reorder(torch.from_numpy(np.random.default_rng(2).permutation(len(lengths))))  # balance_batch
    out["concat"] = time.process_time() - t0
    if layout == "padded":
        carried_bytes = sum(t.nbytes for t in batch.batch.values())
    else:
        carried_bytes = sum(a.nbytes for key in (topk.TOPK_IDS_KEY, topk.TOPK_LOGPROBS_KEY)
                            for a in batch.non_tensor_batch[key])  # fmt: skip
    t0 = time.process_time()
    data = batch.to_tensordict()
    chunks = tu.chunk_tensordict(data, dp)
    received = None
    for chunk in chunks:  # the driver -> each data-parallel rank
        received, _, _, _ = _ray_pickle(chunk)
    out["to_ranks"] = time.process_time() - t0
    if layout == "padded":  # the last rank's share, each response's positions read off the padding
        value = received[topk.TOPK_IDS_KEY]
        valid = (value[..., 0] != 0) | torch.isfinite(received[topk.TOPK_LOGPROBS_KEY][..., 0])
        t0 = time.process_time()
        rows = value[valid], received[topk.TOPK_LOGPROBS_KEY][valid]
        out["read"] = time.process_time() - t0
    else:
        value = received[topk.TOPK_IDS_KEY]
        chunk_lengths = torch.tensor([a.shape[0] for a in value])
        valid = torch.arange(cap)[None, :] < chunk_lengths[:, None]
        t0 = time.process_time()
        rows = topk.carried_rows(value, valid), topk.carried_rows(received[topk.TOPK_LOGPROBS_KEY], valid)
        out["read"] = time.process_time() - t0
    del rows, received, chunks, data, batch
    out["bytes"] = carried_bytes
    out["peak"] = _memory()[1] - baseline
    return out


def carry_at_scale(args: argparse.Namespace) -> None:
    k = args.k
    scales = [("4B", "dense 4B", 1024, 8192), ("30B", "MoE 30B", 4096, 16384)]
    print(f"\nthe carry at scale, K={k}: {args.agent_workers} agent-loop workers, {args.dp} data-parallel ranks, "
          f"one process, torch threads {torch.get_num_threads()}; seconds are this process's CPU seconds "
          f"(load average {os.getloadavg()[0]:.1f} at the start)")  # fmt: skip
    summary = []
    for scale, label, n, cap in scales:
        lengths = lengths_for(scale, n, cap, args.mean_tokens)
        tokens = int(lengths.sum())
        print(f"\n{label}: {n:,} responses of up to {cap:,} tokens; lengths mean {lengths.mean():,.0f}, median "
              f"{np.median(lengths):,.0f}, p90 {np.percentile(lengths, 90):,.0f}, {np.mean(lengths == cap):.1%} at "
              f"the limit; {tokens:,} generated tokens")  # fmt: skip
        padded_bytes = n * cap * (k + 1) * (8 + 4)  # padded to the batch's response_length
        carried_bytes = tokens * k * (4 + 4)
        rows = {}
        sample = lengths[: args.before_sample]
        part = run_layout("padded", sample, cap, k, 1, 1)
        assert part["bytes"] == len(sample) * cap * (k + 1) * 12
        scale_by = n / len(sample)
        rows["before"] = {key: v * scale_by for key, v in part.items()}
        rows["before"]["peak"] = part["peak"]
        rows["before"]["bytes"] = padded_bytes
        rows["before"]["read"] = part["read"] * n / args.dp / len(sample)  # one rank's share, as after
        before_note = (f"the bytes computed ({n:,} x {cap:,} x {k + 1} x 12 B); the seconds measured on "
                       f"{len(sample)} of these responses (one agent-loop worker, one rank) and scaled x{scale_by:.0f}; "
                       f"the peak is that sample's ({part['peak'] / part['bytes']:.1f}x its {part['bytes'] / GB:.2f} GB "
                       "of padded top-K): the whole batch would not fit beside the CI on this 24 GiB machine")  # fmt: skip
        rows["after"] = run_layout("carried", lengths, cap, k, args.agent_workers, args.dp)
        assert rows["after"]["bytes"] == carried_bytes  # the arrays' sizes: tokens x K x (4 + 4) B
        print(f"{'':8s} {'carried':>18s} {'peak':>10s} {'layout':>8s} {'to driver':>10s} {'concat':>8s} "
              f"{'to ranks':>9s} {'read 1 rank':>11s} {'wire in/out of band':>22s}")  # fmt: skip
        for name, r in rows.items():
            peak = f"{r['peak'] / GIB:.2f} GiB" + ("*" if name == "before" else " ")
            print(f"{name:8s} {r['bytes'] / GB:7.2f} GB {r['bytes'] / GIB:5.2f} GiB {peak:>10s} {r['layout']:7.2f}s "
                  f"{r['to_driver']:9.2f}s {r['concat']:7.2f}s {r['to_ranks']:8.2f}s {r['read']:10.3f}s "
                  f"{r['wire_in_band'] / GB:9.2f} / {r['wire_out_of_band'] / GB:5.2f} GB")  # fmt: skip
        print(f"before: {before_note} (* the sample's peak)")
        summary.append((label, rows))
    label, rows = summary[-1]
    after = rows["after"]["bytes"]
    verdict = "under" if after < 4 * GB else "NOT under"
    print(f"\n{label} carry per step: {rows['before']['bytes'] / GB:.1f} GB before -> {after / GB:.2f} GB "
          f"({after / GIB:.2f} GiB) after: {verdict} 4 GB (load average {os.getloadavg()[0]:.1f} at the end)")  # fmt: skip


if __name__ == "__main__":
    main()
