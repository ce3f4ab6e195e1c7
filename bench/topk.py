"""The rollout top-K carry at the paper's scale (issue 18's benchmark, review item 9).

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

    python bench/topk.py [--responses 1024] [--tokens 8192] [--k 20] [--before-responses 8] [--pool 4]
"""

from __future__ import annotations

import argparse
import gc
import pickle
import random
import resource
import sys
import time
import tracemalloc
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from topk_reference import reference_extract_topk, vllm_flat_response

from pdmctl.backends.verl import topk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--responses", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--before-responses", type=int, default=8)
    ap.add_argument("--pool", type=int, default=4)
    ap.add_argument("--server-tokens-per-s", type=float, default=5000.0)
    args = ap.parse_args()
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
    batch = topk.pad_topk(supports, tokens, k)
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
        ("pad the batch", total / pad_s, pad_s),
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
    print(f"\ncarried tensors: {per_response:.2f} MiB per response ([{tokens}, {k + 1}] int64 ids + float32 "
          f"log-probs; as Python lists {list_bytes / 2**20:.1f} MiB), the padded batch "
          f"[{n}, {tokens}, {k + 1}] {carried:.2f} GiB; peak RSS of this process {peak_rss:.2f} GiB")  # fmt: skip

    rate = args.server_tokens_per_s
    for label, seconds in (("before", carry_before), ("dicts", carry_dicts), ("after", carry_after)):
        share = seconds / total * rate
        print(
            f"share of a rollout step at {rate:,.0f} generated tokens/s per vLLM server, {label}: {100 * share:.1f}%"
        )
    print(f"the carry stays under 2% up to {0.02 * total / carry_after:,.0f} generated tokens/s per server")


if __name__ == "__main__":
    main()
