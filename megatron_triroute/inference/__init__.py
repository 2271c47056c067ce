"""Hard-decision inference engine in plain PyTorch (no Megatron, no DeepSpeed): a paged,
precision-segregated KV cache, routed attention and experts executing only the selected work,
batched prefill and decode, and cost-audit counters. See docs/inference.md."""
