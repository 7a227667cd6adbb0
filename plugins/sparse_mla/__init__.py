"""kimi.sparse_mla: fused op (schema, reference and lowerings filled in by the lead)."""
