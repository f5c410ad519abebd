"""kvxfer: disaggregated KV-cache transfer for LLM inference."""

__version__ = "0.1.0"
