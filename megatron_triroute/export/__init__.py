"""Export to Hugging Face format and back (`python -m megatron_triroute.export`, docs/export.md)."""
