"""Train backends: ``torch`` (CPU / one GPU)."""
