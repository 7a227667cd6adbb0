"""Fused ops, one per folder (installed as kimi_compile.plugins)."""
