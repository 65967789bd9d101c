"""Synthetic agentic tasks with verifiable rewards."""
