"""Compiler passes, one per module (installed as kimi_compile.passes)."""
