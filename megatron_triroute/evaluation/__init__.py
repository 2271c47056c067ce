"""Evaluation on the hard path: held-out and tail-bucket perplexity (`megatron_triroute.evaluate`),
and the lm-evaluation-harness model (`megatron_triroute.evaluation.harness`, registered as
`triroute`). Both score through the inference engine, with its cost audit. See README, Evaluation."""
