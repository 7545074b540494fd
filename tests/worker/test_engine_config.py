import pytest

from worker import EngineConfig, TinyLlamaSpec


def test_defaults_are_valid_and_frozen():
    config = EngineConfig()
    assert config.model == "tiny-llama" and config.block_size == 16 and not config.deterministic
    with pytest.raises(AttributeError):
        config.block_size = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("block_size", 0, "block_size"),
        ("cache_budget_tokens", -1, "cache_budget_tokens"),
        ("max_batch_tokens", 4, "max_num_seqs"),  # fewer step tokens than running requests
        ("kv_pool_tokens", 100, "must exceed cache_budget_tokens"),
        ("dtype", "float64", "dtype"),
        ("device", "tpu", "device"),
        ("max_model_len", 1, "max_model_len"),
        ("gpu_memory_fraction", 1.5, "gpu_memory_fraction"),
        ("num_threads", 0, "num_threads"),
        ("model", "", "model"),
        ("max_num_seqs", True, "max_num_seqs"),
        ("cache_protected_share", 1.2, "cache_protected_share"),
        ("cache_protected_share", -0.1, "cache_protected_share"),
        ("cache_protected_share", "0.8", "cache_protected_share"),
        ("cache_protected_share", True, "cache_protected_share"),
    ],
)
def test_bad_values_raise_value_error_naming_the_field(field, value, message):
    kwargs = {"cache_budget_tokens": 1000, field: value}
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_deterministic_mode_needs_a_block_size_compatible_with_64_key_blocks():
    EngineConfig(deterministic=True, block_size=8)
    EngineConfig(deterministic=True, block_size=128)
    EngineConfig(deterministic=False, block_size=24)
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(deterministic=True, block_size=48)


def test_tiny_llama_spec_from_a_mapping_and_its_checks():
    config = EngineConfig(tiny_llama={"hidden_size": 64, "num_heads": 4, "num_kv_heads": 1})
    assert config.tiny_llama == TinyLlamaSpec(hidden_size=64, num_heads=4, num_kv_heads=1)
    with pytest.raises(ValueError, match="num_heads"):
        TinyLlamaSpec(hidden_size=64, num_heads=3)
    with pytest.raises(ValueError, match="num_kv_heads"):
        TinyLlamaSpec(num_heads=4, num_kv_heads=3)
