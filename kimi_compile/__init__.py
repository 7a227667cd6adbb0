"""kimi-compile: ahead-of-time graph compiler for Kimi K3 / K3.1."""
__version__ = "0.1.0"
