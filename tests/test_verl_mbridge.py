"""The Megatron half of the engine on CPU: VeRL 0.9.1's Megatron engine converts a tiny Qwen3 and a tiny
Qwen3-MoE from their Hugging Face configs into Megatron's TransformerConfig through the bridge pdmctl's
presets select (`actor.megatron.vanilla_mbridge=true`: VeRL's legacy `mbridge` path; Megatron-Bridge does
not resolve with vLLM 0.24.0, docs/CLUSTER.md).

No mock: the run's own VeRL config (pdmctl's overrides composed against VeRL's schema), VeRL's own
`MegatronEngine._build_tf_config` (its model-config step: the bridge's import, `AutoBridge.from_config`,
the transformer overrides), mbridge and megatron-core, in a 1-process gloo group with Megatron's parallel
state. What it leaves out: `MegatronEngine.__init__` (it seeds Megatron's CUDA RNG tracker, which needs a
GPU) and the model build and weights after the config (CUDA). FP8 for a MoE needs Transformer Engine
(megatron-core's TransformerConfig asks for its version), which has no CPU build: without it, the test
checks that it fails there and nowhere earlier.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

from tests.distributed import _free_port

pytestmark = pytest.mark.verl

# the shape of tiny.py's Qwen3 (TinyRecipe); the MoE is the same with 8 experts, 2 per token
SHAPE = {
    "vocab_size": 448, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
}  # fmt: skip
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 1}


def write_configs(root: Path) -> dict[str, Path]:
    """config.json of the tiny Qwen3 (tiny.py's recipe) and of a tiny Qwen3-MoE: all the conversion reads."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    from pdmctl.backends.verl import tiny

    recipe = tiny.TinyRecipe()
    assert (SHAPE["hidden_size"], SHAPE["num_hidden_layers"], SHAPE["head_dim"]) == (
        recipe.hidden_size, recipe.layers, recipe.head_dim,
    )  # fmt: skip
    dense = Qwen3Config(**SHAPE, tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])
    moe = Qwen3MoeConfig(**SHAPE, **MOE, mlp_only_layers=[], architectures=["Qwen3MoeForCausalLM"])
    out = {}
    for name, config in (("qwen3", dense), ("qwen3_moe", moe)):
        config.save_pretrained(root / name)
        out[name] = root / name
    return out


def _convert(cases: list[tuple[str, str, str]]) -> list[dict]:
    """For each (model dir, preset, precision), VeRL's Megatron engine's config step, in a 1-rank gloo group
    of this process (the engine reads the parallel state; nothing here needs a second rank)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        mpu.initialize_model_parallel(tensor_model_parallel_size=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the legacy mbridge's FutureWarning, Apex's absence
            return [_convert_one(*case) for case in cases]
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


def _convert_one(model_dir: str, preset: str, precision: str) -> dict:
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    from pdmctl.backends.verl import launch

    run = {
        "model": preset, "precision": precision, "strategy": "megatron", "model_path": model_dir,
        "checkpoint_dir": "/ck", "data_dir": "/data",
        # one rank: the preset's TP and EP (4-8 ranks) set to 1, through the run's own VeRL keys
        "verl": {"actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 1,
                 "actor_rollout_ref.actor.megatron.expert_model_parallel_size": 1},
    }  # fmt: skip
    config = launch.compose(launch.verl_overrides(run))
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    engine = MegatronEngine.__new__(MegatronEngine)  # __init__ seeds Megatron's CUDA RNG tracker
    engine.model_config = HFModelConfig(path=model_dir, load_tokenizer=False)
    engine.engine_config = actor.megatron
    engine.enable_routing_replay = actor.megatron.router_replay.mode != "disabled"
    engine._qat_enabled = False
    engine._build_tf_config()
    c = engine.tf_config
    return {
        "case": (Path(model_dir).name, precision), "bridge": type(engine.bridge).__module__,
        "use_mbridge": actor.megatron.use_mbridge, "vanilla": actor.megatron.vanilla_mbridge,
        "ref_vanilla": config.actor_rollout_ref.ref.megatron.vanilla_mbridge,
        **{k: getattr(c, k) for k in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                                      "kv_channels", "ffn_hidden_size", "num_moe_experts", "moe_router_topk",
                                      "moe_ffn_hidden_size", "qk_layernorm", "normalization", "bf16",
                                      "fp8", "fp8_recipe")},
    }  # fmt: skip


def _check(got: dict, moe: bool, fp8: bool) -> None:
    # the legacy mbridge, not megatron.bridge
    assert got["bridge"].startswith("mbridge.models"), got["bridge"]
    assert got["use_mbridge"] and got["vanilla"] and got["ref_vanilla"]
    assert (got["num_layers"], got["hidden_size"], got["num_attention_heads"]) == (2, 128, 4)
    assert (got["num_query_groups"], got["kv_channels"]) == (2, 32)  # GQA: 2 KV heads of 32
    assert got["qk_layernorm"] and got["normalization"] == "RMSNorm" and got["bf16"]
    if moe:
        assert (got["num_moe_experts"], got["moe_router_topk"], got["moe_ffn_hidden_size"]) == (8, 2, 64)
    else:
        assert got["num_moe_experts"] is None and got["ffn_hidden_size"] == 256
    assert (got["fp8"], got["fp8_recipe"]) == (("hybrid", "blockwise") if fp8 else (None, "delayed"))  # VeRL's FP8-E2E recipe: hybrid, blockwise


def test_tiny_qwen3_and_qwen3_moe_convert_to_megatron_configs(tmp_path: Path) -> None:
    dirs = write_configs(tmp_path)
    cases = [
        (str(dirs["qwen3"]), "qwen3-4b-base", "bf16"),
        (str(dirs["qwen3"]), "qwen3-4b-base", "fp8_e2e"),
        (str(dirs["qwen3_moe"]), "qwen3-30b-a3b-base", "bf16"),
    ]
    results = _convert(cases)
    assert [r["case"] for r in results] == [("qwen3", "bf16"), ("qwen3", "fp8_e2e"), ("qwen3_moe", "bf16")]
    for got in results:
        _check(got, moe=got["case"][0] == "qwen3_moe", fp8=got["case"][1] == "fp8_e2e")


def test_tiny_qwen3_moe_in_fp8_converts_where_transformer_engine_is(tmp_path: Path) -> None:
    """With Transformer Engine (a GPU node's engine environment) the MoE converts in FP8; without it (CPU,
    where TE has no build) megatron-core's TransformerConfig fails on TE's absent version, exactly here."""
    dirs = write_configs(tmp_path)
    case = [(str(dirs["qwen3_moe"]), "qwen3-30b-a3b-base", "fp8_e2e")]
    if importlib.util.find_spec("transformer_engine") is None:
        with pytest.raises(
            TypeError, match=r"'>=' not supported between instances of 'NoneType' and 'Version'"
        ):
            _convert(case)  # is_te_min_version(...) with no TE: get_te_version() is None
        return
    [got] = _convert(case)
    _check(got, moe=True, fp8=True)
