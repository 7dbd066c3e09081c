"""KV transfer between engines (disaggregated prefill/decode)."""
