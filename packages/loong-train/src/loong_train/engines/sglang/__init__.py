"""SGLang servers as rollout engines (see :mod:`loong_train.engines`)."""
