"""Training-loop plumbing."""
