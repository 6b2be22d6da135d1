"""mooncaked: a KVCache-centric, disaggregated LLM serving system after Mooncake."""

__version__ = "0.1.0"
