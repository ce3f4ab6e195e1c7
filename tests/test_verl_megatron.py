"""pdmctl's losses on Megatron's vocabulary-parallel, context-parallel logits (verl 0.9.1 + megatron-core, CPU).

A real `torch.distributed` group of 2 processes (gloo) with Megatron's own
`parallel_state` runs each layout the engine can hand the logits processor:
TP=2 (each rank holds half the vocabulary columns), CP=2 (each rank holds a
zigzag half of every sequence's rows) and TP=2 with fp8 padding. The logits are
packed by VeRL's own `preprocess_thd_engine` exactly as `gptmodel_forward_model_engine`
packs them, the processor's outputs unpacked by VeRL's `postprocess_thd_engine`,
and the diagnostics must equal `pdmctl.masks` on the whole, unsharded logits.
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("verl")
pytest.importorskip("megatron.core")

import torch

from pdmctl import masks
from pdmctl.backends.verl import actor_loss, launch, topk
from tests.distributed import run_group

pytestmark = pytest.mark.verl

LAYOUTS = [(2, 1, False), (1, 2, False), (2, 1, True)]  # (TP, CP, fp8 padding)


def megatron_actor_config(fp8: bool):
    from verl.utils.config import omega_conf_to_dataclass

    from tests.test_verl_loss import K

    run = {
        "model": "qwen3-4b-base", "method": "pdm", "divergence": "topk_kl", "estimator": "exact", "k": K,
        "delta": 0.05, "precision": "fp8_e2e" if fp8 else "bf16", "strategy": "megatron",
        "checkpoint_dir": "/ck", "data_dir": "/data",
    }  # fmt: skip
    config = launch.compose(launch.verl_overrides(run))
    return omega_conf_to_dataclass(config.actor_rollout_ref.actor)


def _megatron_rank(rank: int, world: int, layouts, seeds) -> list[dict]:
    """One rank: for each layout and micro-batch, the engine's two calls on this rank's logits."""
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as mpu
    from verl.models.mcore.util import postprocess_thd_engine, preprocess_thd_engine

    from tests.test_verl_loss import micro_batch

    out = []
    for tp, cp, fp8 in layouts:
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        config = megatron_actor_config(fp8)
        assert config.strategy == "megatron" and actor_loss.megatron_fp8_padding(config) == fp8
        for seed in seeds:
            data, logits, _, valid = micro_batch(seed)
            input_ids = data["input_ids"]
            nested = torch.nested.nested_tensor_from_jagged(logits, input_ids.offsets())
            packed, params, _ = preprocess_thd_engine(nested, pre_process=True, use_fp8_padding=fp8)
            columns = logits.shape[-1] // tp
            first = mpu.get_tensor_model_parallel_rank() * columns
            local = packed[..., first : first + columns].contiguous()  # (1, rows / CP, V / TP)
            processed = actor_loss.pdm_ppo_loss(config, data=data, student_logits=local, data_format="thd")
            assert all(v.shape == local.shape[:2] for v in processed.values())
            model_output = {
                name: postprocess_thd_engine(v, params, input_ids, input_ids.shape[0])
                for name, v in processed.items()
            }
            d = actor_loss.diagnostics_from_model_output(model_output, data)
            out.append({"layout": (tp, cp, fp8), "seed": seed, "rows": int(local.shape[1]),
                        **{name: getattr(d, name)[valid] for name in topk.DIAGNOSTIC_KEYS}})  # fmt: skip
        mpu.destroy_model_parallel()
    return out


def test_megatron_tp_and_cp_shards_give_the_unsharded_mask() -> None:
    from tests.test_verl_loss import micro_batch

    seeds = [0, 1]
    results = run_group(_megatron_rank, 2, LAYOUTS, seeds)
    expected = {}
    for seed in seeds:  # the ranks read the carried layout, the expectation the padded one it replaced
        data, logits, rows, valid = micro_batch(seed, layout="padded")
        expected[seed] = masks.token_diagnostics(
            logits[rows[valid]], data["responses"][valid], data[topk.TOPK_IDS_KEY][valid],
            data[topk.TOPK_LOGPROBS_KEY][valid].float(), data["rollout_log_probs"][valid].float(),
            data["advantages"][valid].float(), method="pdm", divergence="topk_kl", estimator="exact", delta=0.05,
        )  # fmt: skip
    layouts_seen = set()
    for rank_results in results:
        assert len(rank_results) == len(LAYOUTS) * len(seeds)
        for got in rank_results:
            want = expected[got["seed"]]
            layouts_seen.add(got["layout"])
            assert torch.equal(got["keep"], want.keep), got["layout"]
            assert torch.equal(got["out_of_region"], want.out_of_region), got["layout"]
            for name in ("divergence", "ddot", "ratio", "log_ratio"):
                torch.testing.assert_close(got[name], getattr(want, name), rtol=1e-5, atol=1e-6)
    assert layouts_seen == set(LAYOUTS)
    fp8_rows = {r["rows"] for r in results[0] if r["layout"][2]}
    assert all(n % 256 == 0 for n in fp8_rows)  # fp8 padding really changed the layout (TP x 128 total)
    assert any(not bool(expected[s].keep.all()) for s in seeds)  # some tokens masked: not vacuous
