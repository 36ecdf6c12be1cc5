"""Qwen3-family attention over a paged KV cache: norms, RoPE, the cache, params, the layer."""

from atlas_jax.attention.kv_cache import KVPages, PagedKVCache, slot_mapping
from atlas_jax.attention.layer import MAX_DECODE_TOKENS, decode, prefill
from atlas_jax.attention.params import AttentionParams, from_hf_tensors, init_params

__all__ = [
    "MAX_DECODE_TOKENS",
    "AttentionParams",
    "KVPages",
    "PagedKVCache",
    "decode",
    "from_hf_tensors",
    "init_params",
    "prefill",
    "slot_mapping",
]
