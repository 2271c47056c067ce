"""Data pipeline: raw shards (Pile, RedPajama, JSON lines, text) -> Megatron-Core indexed datasets.

Produces train / validation datasets, tail-bucket evaluation sets with loss masks, a
sentencepiece tokenizer and its per-token tables. Entry point: `python -m data_prep` (see
`data_prep/__main__.py` and docs/data_prep.md). The training code imports only
`data_prep.tables.load_token_tables`.
"""
