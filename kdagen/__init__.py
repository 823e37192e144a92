"""kdagen: a kernel compiler for Kimi Delta Attention (KDA)."""

__version__ = "0.1.0"
