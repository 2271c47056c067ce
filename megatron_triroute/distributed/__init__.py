"""Process launch and process-group plumbing."""
