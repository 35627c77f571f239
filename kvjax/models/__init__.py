"""Toy Qwen3.5 (GDN + gated attention) and DeepSeek (MLA + DSA) models."""
