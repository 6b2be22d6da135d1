"""The KVCache pool's service on one host and its client: DRAM pool, SSD tier, context-cache records."""
