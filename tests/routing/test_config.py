import pytest

from megatron_triroute.config import ConfigError, TriRouteConfig


def test_defaults_validate_and_round_trip():
    cfg = TriRouteConfig().validate()
    again = TriRouteConfig.from_dict(cfg.to_dict())
    assert again == cfg
    assert again.router.bits == (2, 4, 8, 16)


@pytest.mark.parametrize(
    "section,field,value,needle",
    [
        ("router", "top_k", 10, "router.top_k=10"),
        ("router", "bits", (2, 3, 16), "router.bits=(2, 3, 16)"),
        ("router", "uniform_bits", 12, "router.uniform_bits=12"),
        ("budget", "flops_target", 0.0, "budget.flops_target=0.0"),
        ("budget", "mem_target", 1.5, "budget.mem_target=1.5"),
        ("model", "n_kv_heads", 3, "model.n_kv_heads=3"),
        ("router", "sharing", "twin", "router.sharing='twin'"),
    ],
)
def test_errors_name_field_value_and_fix(section, field, value, needle):
    cfg = TriRouteConfig()
    setattr(getattr(cfg, section), field, value)
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert needle in str(err.value)
    assert "Fix:" in str(err.value)


def test_top_k_bound_counts_null_expert():
    cfg = TriRouteConfig()
    cfg.router.num_experts, cfg.router.top_k = 2, 3
    cfg.validate()  # 2 real + null = 3 options
    cfg.router.null_expert = False
    with pytest.raises(ConfigError, match="top_k"):
        cfg.validate()


def test_group_size_must_divide_head_dim():
    cfg = TriRouteConfig()
    cfg.model.d_model, cfg.model.n_heads = 96, 4  # d_head = 24
    cfg.router.kv_group_size = 16
    with pytest.raises(ConfigError, match="kv_group_size"):
        cfg.validate()


def test_flex_local_attention_needs_a_head_dim_of_16():
    cfg = TriRouteConfig()
    cfg.model.d_model, cfg.model.n_heads = 64, 8  # d_head = 8
    cfg.router.kv_group_size, cfg.router.local_attention = 8, "flex"
    with pytest.raises(ConfigError, match="local_attention.*d_head >= 16.*use blocks"):
        cfg.validate()
    cfg.router.local_attention = "auto"  # blocks at this head dim
    cfg.validate()
    cfg.model.n_heads, cfg.router.local_attention = 4, "flex"  # d_head = 16
    cfg.validate()


def test_unknown_key_is_refused():
    data = TriRouteConfig().to_dict()
    data["router"]["topk"] = 2
    with pytest.raises(ConfigError, match="unknown keys"):
        TriRouteConfig.from_dict(data)
