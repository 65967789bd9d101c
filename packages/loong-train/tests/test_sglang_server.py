"""The embedded engine's SGLang-compatible server, driven over real loopback HTTP: generation
(plain, streamed, prefill-only scoring), pause, and the requests it refuses.

References: the model's own forward pass (float64 log-softmax) and a second EmbeddedEngine with
the same seed. The client is Loong's own, ``loong_agentflow.SGLangEngine``.
"""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest
import torch
from train_testkit import PROMPT_IDS, forward_logprobs, serve_engine

from loong_agentflow.sglang_client import SGLangClientConfig, SGLangEngine, SGLangError
from loong_core.protocols import SamplingParams
from loong_train.engines.embedded.engine import EmbeddedEngine
from loong_train.models.decoder import CausalLM


def test_generate_logprobs_equal_engine_and_forward_pass(model_dir):
    sampling = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.95)
    reference = EmbeddedEngine(CausalLM.from_pretrained(model_dir), seed=5)
    want = reference.generate_batch([PROMPT_IDS], [sampling])[0]
    with serve_engine(EmbeddedEngine(CausalLM.from_pretrained(model_dir), seed=5)) as (url, _):

        async def run():
            client = SGLangEngine(SGLangClientConfig(url=url))
            try:
                return await client.generate(PROMPT_IDS, sampling)
            finally:
                await client.aclose()

        span = asyncio.run(run())
    assert span.token_ids == want.token_ids and span.logprobs == want.logprobs  # same code, same seed
    assert span.weight_version == 0 and span.is_model
    full = forward_logprobs(reference.model, PROMPT_IDS + span.token_ids, 0.8)[len(PROMPT_IDS) - 1 :]
    torch.testing.assert_close(torch.tensor(span.logprobs, dtype=torch.float64), full, rtol=0, atol=1e-5)


def test_streamed_generate_is_the_same_answer_event_by_event(model_dir):
    """``stream: true``: cumulative events (as SGLang streams by default), the last with the
    finish reason, then [DONE]; the client's deltas join to the unstreamed answer of the same
    seed; a client that closes the stream early frees the server's row."""
    sampling = SamplingParams(max_new_tokens=12, temperature=0.9)
    want = EmbeddedEngine(CausalLM.from_pretrained(model_dir), seed=5).generate_batch(
        [PROMPT_IDS], [sampling]
    )[0]
    engine = EmbeddedEngine(CausalLM.from_pretrained(model_dir), seed=5)
    with serve_engine(engine) as (url, _):

        async def run():
            client = SGLangEngine(SGLangClientConfig(url=url))
            try:
                deltas = [d async for d in client.stream(PROMPT_IDS, sampling)]
                long = SamplingParams(max_new_tokens=400, temperature=0.9)
                early = client.stream(PROMPT_IDS, long)
                first = await anext(early)
                await early.aclose()
                for _ in range(200):
                    if not engine.running:
                        break
                    await asyncio.sleep(0.01)
                return deltas, first, engine.running
            finally:
                await client.aclose()

        deltas, first, running = asyncio.run(run())
        body = {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 3}, "return_logprob": True}
        raw = httpx.post(f"{url}/generate", json={**body, "stream": True}).text
    assert [t for d in deltas for t in d.token_ids] == want.token_ids and len(deltas) > 1
    assert [x for d in deltas for x in d.logprobs] == want.logprobs
    assert first.token_ids and running == 0
    events = [e[6:] for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    answers = [msgspec.json.decode(e) for e in events[:-1]]
    lengths = [len(a["output_ids"]) for a in answers]
    assert lengths == sorted(lengths) and lengths[-1] == 3
    assert all(a["output_ids"] == answers[-1]["output_ids"][: len(a["output_ids"])] for a in answers)
    assert [a["meta_info"]["finish_reason"] for a in answers][-1] == {"type": "length", "length": 3}
    assert all(a["meta_info"]["finish_reason"] is None for a in answers[:-1])


def test_incremental_streaming_sends_each_token_once(model_dir):
    """A server started with ``--incremental-streaming-output`` (SGLang's ``--stream-output``):
    each event's ``output_ids`` and output logprob entries are only its new ones, so they join
    to the unstreamed answer of the same seed (SGLang's own ``test_skip_tokenizer_init`` joins
    them so); counts stay cumulative, the last event has the finish reason."""
    sampling = SamplingParams(max_new_tokens=12, temperature=0.9)
    want = EmbeddedEngine(CausalLM.from_pretrained(model_dir), seed=5).generate_batch(
        [PROMPT_IDS], [sampling]
    )[0]
    engine = EmbeddedEngine(CausalLM.from_pretrained(model_dir), seed=5)
    body = {
        "input_ids": PROMPT_IDS,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0.9},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
        "stream": True,
    }
    with serve_engine(engine, incremental_streaming=True) as (url, _):
        raw = httpx.post(f"{url}/generate", json=body, timeout=60).text

        async def via_client():  # Loong's client reads cumulative events: it refuses these by name
            client = SGLangEngine(SGLangClientConfig(url=url))
            try:
                return [d async for d in client.stream(PROMPT_IDS, sampling)]
            finally:
                await client.aclose()

        with pytest.raises(SGLangError, match="--incremental-streaming-output"):
            asyncio.run(via_client())
    events = [e[6:] for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    answers = [msgspec.json.decode(e) for e in events[:-1]]
    assert sum(bool(a["output_ids"]) for a in answers) > 1
    assert [t for a in answers for t in a["output_ids"]] == want.token_ids
    entries = [e for a in answers for e in a["meta_info"]["output_token_logprobs"]]
    assert [e[1] for e in entries] == want.token_ids and [e[0] for e in entries] == want.logprobs
    for a in answers:
        meta = a["meta_info"]
        assert [e[1] for e in meta["output_token_logprobs"]] == a["output_ids"]
        assert len(meta["output_top_logprobs"]) == len(a["output_ids"])
        assert len(meta["input_token_logprobs"]) == len(PROMPT_IDS)  # the prompt's, on every event
    counts = [a["meta_info"]["completion_tokens"] for a in answers]
    assert counts == sorted(counts) and counts[-1] == 12
    assert answers[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


def test_prefill_only_scoring_equals_forward_log_softmax(model_dir):
    model = CausalLM.from_pretrained(model_dir)
    ids = [*PROMPT_IDS, 40, 41, 2, 7]
    want = forward_logprobs(model, ids)
    with serve_engine(EmbeddedEngine(model, seed=0)) as (url, _):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
        out = httpx.post(f"{url}/generate", json={**body, "logprob_start_len": 0}).json()
        tail = httpx.post(f"{url}/generate", json={**body, "logprob_start_len": 4}).json()
        default = httpx.post(f"{url}/generate", json=body).json()

        async def via_client():
            client = SGLangEngine(SGLangClientConfig(url=url))
            try:
                return await client.prompt_logprobs(ids, start=0)
            finally:
                await client.aclose()

        scored = asyncio.run(via_client())
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["output_token_logprobs"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 0
    assert [t[1] for t in meta["input_token_logprobs"]] == ids
    assert meta["input_token_logprobs"][0] == [None, ids[0], None]
    got = torch.tensor([t[0] for t in meta["input_token_logprobs"][1:]], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert scored == [t[0] for t in meta["input_token_logprobs"][1:]]
    assert tail["meta_info"]["input_token_logprobs"] == [
        [None, ids[4], None],
        *meta["input_token_logprobs"][5:],
    ]
    assert default["meta_info"]["input_token_logprobs"] == [[None, ids[-1], None]]


def test_generate_response_shape_batch_and_stop(model_dir):
    engine = EmbeddedEngine(CausalLM.from_pretrained(model_dir), seed=1)
    free = EmbeddedEngine(CausalLM.from_pretrained(model_dir), seed=1)
    stop = free.generate_batch([PROMPT_IDS], [SamplingParams(max_new_tokens=20)])[0].token_ids[3]
    with serve_engine(engine, model_path=str(model_dir)) as (url, _):
        body = {
            "input_ids": PROMPT_IDS,
            "sampling_params": {"max_new_tokens": 20, "stop_token_ids": [stop], "skip_special_tokens": True},
            "return_logprob": True,
            "rid": "r1",
        }
        one = httpx.post(f"{url}/generate", json=body).json()
        batch = httpx.post(
            f"{url}/generate",
            json={"input_ids": [PROMPT_IDS, [1, 2]], "sampling_params": {"max_new_tokens": 3}},
        ).json()
        info = httpx.get(f"{url}/get_model_info").json()
        flushed = httpx.post(f"{url}/flush_cache")
    meta = one["meta_info"]
    assert one["output_ids"][-1] == stop and meta["finish_reason"] == {"type": "stop", "matched": stop}
    assert meta["id"] == "r1" and meta["weight_version"] == "0"
    assert [t[1] for t in meta["output_token_logprobs"]] == one["output_ids"]
    assert all(t[2] is None for t in meta["output_token_logprobs"])
    assert meta["completion_tokens"] == len(one["output_ids"]) and meta["prompt_tokens"] == len(PROMPT_IDS)
    assert [len(b["output_ids"]) for b in batch] == [3, 3]
    assert batch[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert "output_token_logprobs" not in batch[0]["meta_info"]
    assert info["model_path"] == str(model_dir) and info["is_generation"] and info["weight_version"] == "0"
    assert flushed.status_code == 200


@pytest.mark.parametrize(
    "field",
    [
        {"token_ids_logprob": [1, 2]},  # test_srt_endpoint.py's token-id logprobs
        {"return_text_in_logprobs": True},  # test_skip_tokenizer_init.py: texts need a tokenizer
        {"custom_logit_processor": "{}"},  # test_srt_endpoint.py's custom logit processor
    ],
)
def test_sglang_fields_this_server_does_not_implement_are_refused_by_name(model_dir, field):
    """Issue 20 points 5 and 6: an SGLang field the embedded server does not implement is a 400
    naming it, never silently ignored; the same field left empty is accepted."""
    with serve_engine(EmbeddedEngine(CausalLM.from_pretrained(model_dir))) as (url, _):
        body = {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 1}}
        refused = httpx.post(f"{url}/generate", json={**body, **field})
        empty = httpx.post(f"{url}/generate", json={**body, **{k: None for k in field}})
    (name,) = field
    assert refused.status_code == 400 and refused.json()["param"] == name
    assert "not supported" in refused.json()["message"] and empty.status_code == 200


def test_top_logprobs_as_sglang_shapes_them_on_both_sides(model_dir):
    """Issue 20 point 3 (test_srt_endpoint.py's top-logprob cases): with the default
    logprob_start_len the input side is SGLang's [None]; while generating, each output token has
    its k most likely tokens at the sampling temperature, most likely first, against a float64
    forward pass, the sampled token's entry equal to its output logprob; streamed, the last event
    carries the same lists as the unstreamed answer of the same seed."""
    temperature, k = 0.7, 4
    body = {"input_ids": PROMPT_IDS, "return_logprob": True, "top_logprobs_num": k}
    sampling = {"max_new_tokens": 6, "temperature": temperature}
    with serve_engine(EmbeddedEngine(CausalLM.from_pretrained(model_dir), seed=3)) as (url, _):
        last = httpx.post(f"{url}/generate", json={**body, "sampling_params": {"max_new_tokens": 0}}).json()
        one = httpx.post(f"{url}/generate", json={**body, "sampling_params": sampling, "rid": "a"}).json()
    streaming = {**body, "sampling_params": sampling, "stream": True}
    with (
        serve_engine(EmbeddedEngine(CausalLM.from_pretrained(model_dir), seed=3)) as (url, _),
        httpx.stream("POST", f"{url}/generate", json=streaming) as r,
    ):
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert last["meta_info"]["input_top_logprobs"] == [None]
    meta, out = one["meta_info"], one["output_ids"]
    tops = meta["output_top_logprobs"]
    assert len(tops) == len(out) == len(meta["output_token_logprobs"]) and all(len(t) == k for t in tops)
    model = CausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT_IDS + out])).double()[0, len(PROMPT_IDS) - 1 : -1]
    want = torch.log_softmax(logits / temperature, -1).topk(k, dim=-1)
    for i, top in enumerate(tops):
        assert [t for _, t, _ in top] == want.indices[i].tolist()
        got = torch.tensor([lp for lp, _, _ in top], dtype=torch.float64)
        torch.testing.assert_close(got, want.values[i], rtol=0, atol=1e-5)
        sampled = dict((t, lp) for lp, t, _ in top).get(out[i])
        assert sampled is None or sampled == meta["output_token_logprobs"][i][0]
    streamed = msgspec.json.decode(events[-2])  # then [DONE]
    assert streamed["output_ids"] == out
    assert streamed["meta_info"]["output_top_logprobs"] == tops


def test_pause_holds_requests_until_continue(model_dir):
    with serve_engine(EmbeddedEngine(CausalLM.from_pretrained(model_dir))) as (url, _):

        async def run():
            client = SGLangEngine(SGLangClientConfig(url=url))
            try:
                client.pause()
                task = asyncio.create_task(client.generate(PROMPT_IDS, SamplingParams(max_new_tokens=4)))
                await asyncio.sleep(0.5)
                held = not task.done()
                client.resume()
                span = await asyncio.wait_for(task, 30)
                return held, span
            finally:
                await client.aclose()

        held, span = asyncio.run(run())
    assert held and len(span.token_ids) == 4


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/generate", {"sampling_params": {"max_new_tokens": 2}}, "input_ids"),
        ("/generate", {"input_ids": "hello"}, "input_ids"),
        ("/generate", {"input_ids": [1, 2, 999]}, "input_ids"),
        ("/generate", {"input_ids": [[1, 2], [3, "x"]]}, "input_ids[1]"),
        (
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}},
            "sampling_params.temperature",
        ),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"top_k": 5}}, "sampling_params.top_k"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
        ("/generate", {"input_ids": [1, 2], "return_logprob": "yes"}, "return_logprob"),
        ("/generate", {"input_ids": [1, 2], "logprob_start_len": 9}, "logprob_start_len"),
        ("/generate", {"input_ids": [1, 2], "top_logprobs_num": -1}, "top_logprobs_num"),
        ("/generate", {"input_ids": [1, 2], "top_logprobs_num": "4"}, "top_logprobs_num"),
        ("/generate", {"text": "hi"}, "text"),
        # SGLang's TestRequestLengthValidation: prompt + max_new_tokens past the context is a 400
        ("/generate", {"input_ids": [1] * 500, "sampling_params": {"max_new_tokens": 13}}, "input_ids"),
        (
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"temperature": 1e-50}},
            "sampling_params.temperature",
        ),
        ("/pause_generation", {"mode": "later"}, "mode"),
        (
            "/update_weights_from_distributed",
            {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"},
            "group_name",
        ),
        ("/destroy_weights_update_group", {"group_name": "nope"}, "group_name"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1}, "rank_offset"),
        ("/update_weights_from_disk", {"model_path": "/nonexistent"}, "model_path"),
        (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": ["not base64!"]},
            "serialized_named_tensors",
        ),
    ],
)
def test_bad_requests_answer_400_naming_the_field(model_dir, path, body, param):
    with serve_engine(EmbeddedEngine(CausalLM.from_pretrained(model_dir))) as (url, _):
        response = httpx.post(f"{url}{path}", json=body)
        assert response.status_code == 400, response.text
        error = response.json()
        assert error["param"] == param and param in error["message"] and error["success"] is False
        garbage = httpx.post(
            f"{url}/generate", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert garbage.status_code == 400 and garbage.json()["param"] == "body"
        assert httpx.get(f"{url}/health").status_code == 200
        ok = httpx.post(
            f"{url}/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        )
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2


def test_api_key_is_required_when_set(model_dir):
    with serve_engine(EmbeddedEngine(CausalLM.from_pretrained(model_dir)), api_key="s3cret") as (url, _):
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(f"{url}/generate", json=body).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert httpx.post(f"{url}/generate", json=body, headers=wrong).status_code == 401
        assert httpx.get(f"{url}/get_weight_version").status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200

        async def run(key):
            client = SGLangEngine(SGLangClientConfig(url=url, api_key=key, retries=0))
            try:
                return await client.generate([1, 2], SamplingParams(max_new_tokens=2))
            finally:
                await client.aclose()

        assert len(asyncio.run(run("s3cret")).token_ids) == 2
        with pytest.raises(SGLangError, match="401"):
            asyncio.run(run(None))
