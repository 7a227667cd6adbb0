"""kimi.kda: fused op (schema, reference and lowerings filled in by the lead)."""
