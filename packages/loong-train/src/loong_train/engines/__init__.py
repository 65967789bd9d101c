"""Rollout engines: ``embedded`` (in-process torch, also served over SGLang's HTTP API by
``sglang_server``) and ``sglang`` (a supervised SGLang server per worker: ``sglang_supervisor``,
``sglang_rollout``)."""
