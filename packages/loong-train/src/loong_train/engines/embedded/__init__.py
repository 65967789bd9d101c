"""The embedded engine: torch in the rollout worker's process (see :mod:`loong_train.engines`)."""
