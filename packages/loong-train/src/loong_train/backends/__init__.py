"""Train backends behind one seam: the :class:`~loong_train.backends.base.TrainBackend` protocol,
built by :func:`~loong_train.backends.base.build_backend` from ``train.backend``: ``torch``
(:mod:`torch_backend`) or ``megatron`` (:mod:`megatron`, imported only when chosen)."""
