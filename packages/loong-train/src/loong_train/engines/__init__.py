"""Rollout engines: ``embedded`` (in-process torch)."""
