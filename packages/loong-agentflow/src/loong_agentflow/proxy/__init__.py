"""The AgentFlow proxy: an OpenAI-compatible server that records token-exact black-box episodes.

Any program that speaks the OpenAI API (the ``openai`` SDK, LangChain, a shell script with curl)
can be an agent: point ``OPENAI_BASE_URL`` at the proxy and use the session's API key. The proxy
renders the chat template itself, asks a :class:`~loong_core.protocols.RolloutEngine` for token
ids with logprobs and weight versions, and records every call of the session.

Endpoints (all need ``Authorization: Bearer <session key>``; unknown or finished keys get 401):

- ``POST /v1/chat/completions``: ``messages``, ``tools`` (Hermes ``<tool_call>`` format),
  ``stream`` (+ ``stream_options.include_usage``), ``n``, ``temperature``, ``top_p``,
  ``max_tokens`` / ``max_completion_tokens``, ``stop``, ``logprobs``, and vLLM's
  ``return_token_ids`` (the answer carries ``prompt_token_ids`` and ``choices[].token_ids``: the
  ids the trajectory records; streamed, each chunk carries the ids of what it shows).
- ``POST /v1/completions``: ``prompt`` (text or token ids), same sampling fields, ``logprobs`` <= 1,
  ``return_token_ids`` (on each choice, as vLLM answers; not in streamed completions).
- ``GET /v1/models``: the one served model.
- ``POST /v1/sessions/reward``: ``{"reward": float, "turn_rewards": [float], "done": bool}`` sets
  the episode's reward from inside the agent (or from its environment); ``done: true`` also ends
  the session, after which its key answers 401.

Streaming is live: chunks leave as the engine samples (an engine with ``stream``, see
:class:`~loong_core.protocols.RolloutEngine`; one without answers each completion whole), and a
``stop`` string ends the engine call at the token that completes it, streamed or not.

Token exactness: when a chat call's messages extend an earlier call of the session (that call's
messages, then the assistant reply it returned, then new messages, with the same tools), the
prompt is that call's prompt ids + its completion ids + the renderer's continuation for the new
messages only; the model's tokens are never re-tokenized. Text completions chain the same way by
text prefix. Errors are OpenAI-style bodies: malformed JSON or unsupported parameters 400 (naming
the parameter), oversize bodies 413, engine failures 500. A client that disconnects while its
completion is generated cancels the engine call.

Lifecycle::

    proxy = ProxyServer(engine, ChatMLRenderer(codec))
    await proxy.start()                      # binds 127.0.0.1 on a free port by default
    session = proxy.open_session(spec)       # session.api_key, proxy.base_url
    ...                                      # the agent calls the proxy
    proxy.close_session(session)
    rows = session.trajectories(reward, status)
    await proxy.stop()

Modules, from the wire up:

- ``wire``: the OpenAI request Structs, their checks, error bodies and SSE framing;
- ``render``: chat templates (messages + tools -> token ids) and completions -> tool calls;
- ``session``: one episode's call records, chaining, and its trajectory rows;
- ``config``: :class:`ProxyConfig`;
- ``sampling``: a request's sampling parameters, checked against the config, model and budget;
- ``choices``: engine tokens -> a finished choice, followed live while they arrive;
- ``responses``: JSON bodies and SSE chunks of the answers;
- ``endpoints``: what the chat and the text completion endpoint each do their own way;
- ``asgi``: the live event-stream response and client-disconnect handling;
- ``server``: :class:`ProxyServer`, its lifecycle and the one call path both endpoints share.
"""

from loong_agentflow.proxy.config import ProxyConfig
from loong_agentflow.proxy.server import ProxyServer

__all__ = ["ProxyConfig", "ProxyServer"]
