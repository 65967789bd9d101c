"""Rollout engines behind one seam (:mod:`base`: the ``WorkerEngine`` protocol and ``build_engine``):

- :mod:`embedded`: in-process torch with continuous batching (``engine``, ``batching``), weight
  updates between decode steps (``host``), and SGLang's HTTP API served over it (``http_app``,
  ``http_generate``, ``http_control``, ``http_weights``, ``wire``: ``loong-train serve-sglang``);
- :mod:`sglang`: a supervised SGLang server per rollout worker (``supervisor``, ``rollout``).
"""
