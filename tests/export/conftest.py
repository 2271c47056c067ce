"""Fixtures of the export tests: tiny checkpoints written at TP=2, EP=2 and PP=2 (gloo, one spawn),
and a Hugging Face cache isolated in a temporary directory, offline."""

from tests.hf_home import isolate_hf_home

# Before anything imports transformers. Every process that imports this module (the test process,
# the spawned ranks) removes its own directory at exit.
isolate_hf_home(even_if_imported=True)

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.dist_utils import run_distributed  # noqa: E402

LAYOUTS = {"tp2": (dict(tp=2), "triroute"), "ep2": (dict(ep=2), "triroute"), "pp2": (dict(pp=2), "triroute"),
           "dense_tp2": (dict(tp=2), "dense")}
STEP = 7


def tiny_config(system: str, vocab: int):
    from megatron_triroute.config import TriRouteConfig
    from megatron_triroute.systems import system_config

    cfg = TriRouteConfig()
    m, r = cfg.model, cfg.router
    m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size, m.seq_len = 32, 2, 4, 2, 64, vocab, 64
    r.d_router, r.num_experts, r.window, r.kv_group_size = 16, 4, 3, 8
    return system_config(system, cfg.validate()).validate()


def perturb(model) -> None:
    """Every parameter moved off its initial value by a function of the value itself (the same at
    every layout): experts and controllers get distinct, non-trivial weights."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.sin(17.0 * p) + 0.01)


def build(cfg, tables, tp=1, pp=1, ep=1, seed=5):
    from megatron.core import parallel_state

    from megatron_triroute.model.gpt import TriRouteGPTModel
    from megatron_triroute.model.spec import transformer_config
    from megatron_triroute.parallel import initialize_parallel

    groups = initialize_parallel(tp, pp, ep)
    torch.manual_seed(seed)
    model = TriRouteGPTModel(transformer_config(cfg, tensor_parallel=tp, pipeline_parallel=pp), cfg, groups=groups,
                             pre_process=parallel_state.is_pipeline_first_stage(),
                             post_process=parallel_state.is_pipeline_last_stage(), tables=tables)
    return model, groups


def save(root, model, groups, cfg, data, system):
    import torch.distributed as dist

    from megatron_triroute.checkpoint.sharded import GLOBAL_FORMAT, plan_state_save
    from megatron_triroute.checkpoint.store import save_checkpoint

    meta = {"step": STEP, "config": {"name": "export-test", "system": system, "triroute": cfg.to_dict(),
                                     "data": {"path": str(data)}},
            "checkpoint_format": GLOBAL_FORMAT,
            "layout": {"world_size": groups.world_size, "tp": groups.tp, "pp": groups.pp, "ep": groups.ep,
                       "dp": groups.dp}}
    save_checkpoint(root, STEP, {}, meta, rank=groups.rank, world_size=groups.world_size, barrier=dist.barrier,
                    write_extra=lambda directory: plan_state_save(directory, model, None))


def _write_checkpoints(rank, world_size, root, data, layouts):
    from safetensors.torch import save_file

    from megatron_triroute.vocab import load_token_tables
    from megatron_triroute.parallel import destroy_parallel
    from megatron_triroute.routing.side_features import TokenTables

    log_prob, word_start, eod = load_token_tables(f"{data}/tokenizer/token_tables.safetensors")
    for name, (layout, system) in layouts.items():
        cfg = tiny_config(system, log_prob.numel())
        model, groups = build(cfg, TokenTables(log_prob, word_start, eod), **layout)
        perturb(model)
        if system == "triroute":  # nonzero prices: decisions are priced per request position
            model.budget.prices.copy_(torch.tensor([0.05, 0.02], dtype=model.budget.prices.dtype))
        save(f"{root}/{name}", model, groups, cfg, data, system)
        if layout.get("ep", 1) > 1 and layout.get("pp", 1) == 1 and cfg.router.expert_routing:
            # This rank's experts under their global ids: the reference an export must match.
            local = cfg.router.num_experts // groups.ep
            ref = {}
            for key, value in model.state_dict().items():
                if ".moe.experts.w" in key and torch.is_tensor(value):  # decoder.layers.<l>.….moe.experts.w1.weight
                    layer, w = int(key.split(".")[2]), key.split(".moe.experts.")[1].split(".")[0]
                    for e, expert in enumerate(value.unbind(0)):
                        ref[f"{layer}.{groups.ep_rank * local + e}.{w}"] = expert.detach().clone().contiguous()
            save_file(ref, f"{root}/{name}_experts_rank{rank}.safetensors")
        destroy_parallel()


@pytest.fixture(scope="session")
def checkpoints(tiny_data, tmp_path_factory):  # noqa: F811
    """{name: checkpoint root}: tiny TriRoute models saved at TP=2, EP=2, PP=2 and a Dense one at
    TP=2 (one spawn of two gloo ranks)."""
    root = tmp_path_factory.mktemp("export_ckpts")
    run_distributed(_write_checkpoints, 2, str(root), str(tiny_data), LAYOUTS, timeout=300)
    return {name: root / name for name in LAYOUTS} | {"root": root}


@pytest.fixture(scope="session")
def exports(checkpoints, tmp_path_factory):
    """{name: exported Hugging Face directory} of every checkpoint (in-process export)."""
    from megatron_triroute.export.exporter import export

    root = tmp_path_factory.mktemp("hf")
    return {name: export(checkpoints[name], root / name) for name in LAYOUTS}


@pytest.fixture(scope="session")
def ep4_checkpoint(tiny_data, tmp_path_factory):  # noqa: F811
    """The tiny TriRoute model saved at EP=4 (four gloo ranks) and its experts by global id."""
    root = tmp_path_factory.mktemp("export_ep4")
    run_distributed(_write_checkpoints, 4, str(root), str(tiny_data), {"ep4": (dict(ep=4), "triroute")}, timeout=300)
    return root
