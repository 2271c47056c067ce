"""Data pipeline: raw shards (Pile, RedPajama, JSON lines, text) -> Megatron-Core indexed datasets.

Produces train / validation datasets, tail-bucket evaluation sets with loss masks, a
sentencepiece tokenizer and its per-token tables. Entry point: `python -m data_prep` (see
`data_prep/__main__.py` and docs/data_prep.md). It imports `megatron_triroute` for the shared
files (the tokenizer and its tables: `megatron_triroute/vocab.py`; crash-safe writes:
`megatron_triroute/durability.py`); the package never imports data_prep.
"""
