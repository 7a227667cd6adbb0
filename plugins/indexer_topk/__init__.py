"""kimi.indexer_topk: fused op (schema, reference and lowerings filled in by the lead)."""
