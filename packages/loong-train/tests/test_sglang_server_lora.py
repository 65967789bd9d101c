"""The embedded SGLang-compatible server's LoRA endpoints (``--enable-lora``): adapters that
``peft`` saved, loaded through ``/load_lora_adapter_from_tensors`` and named by ``lora_path``,
sample their own policy. Reference: the ``peft`` model itself in float64 (the adapter unmerged,
``W x + alpha / r * B A x``), an implementation independent of the server's merge."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import pickle
import threading
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file
from train_testkit import PROMPT_IDS, forward_logprobs, serve_engine

from loong_train.backends.config import LoraConfig
from loong_train.backends.lora import add_adapters, save_adapter
from loong_train.engines.embedded.engine import EmbeddedEngine
from loong_train.engines.embedded.http_app import LoraOptions
from loong_train.models.decoder import CausalLM


def _peft_adapter(model_dir: Path, out: Path, rank: int, targets, seed: int) -> CausalLM:
    """The checkpoint with a random adapter (float32 values), saved by ``peft`` into ``out``;
    returns the adapted model in float64."""
    model = CausalLM.from_pretrained(model_dir)
    peft_config = add_adapters(model, LoraConfig(rank=rank, alpha=3.0 * rank, target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    save_adapter(model, peft_config, out)
    return model.double()


def _payload(tensors) -> str:
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def _load_body(path: Path, name: str, **changes) -> dict:
    """``/load_lora_adapter_from_tensors``'s body for the PEFT adapter saved in ``path``."""
    config = json.loads((path / "adapter_config.json").read_text())
    tensors = load_file(str(path / "adapter_model.safetensors"))
    body = {"lora_name": name, "config_dict": config, "serialized_named_tensors": [_payload(tensors)]}
    return {**body, **changes}


def _generate_body(adapter: str | None, max_new_tokens: int = 6) -> dict:
    return {
        "input_ids": PROMPT_IDS,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "lora_path": adapter,
    }


def _gap(answer: dict, reference: CausalLM) -> float:
    """The largest gap between an answer's prompt and output logprobs and ``reference``'s."""
    meta = answer["meta_info"]
    got = [lp for lp, _, _ in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]]
    want = forward_logprobs(reference, PROMPT_IDS + answer["output_ids"])
    return (torch.tensor(got, dtype=torch.float64) - want).abs().max().item()


def test_served_adapters_sample_their_own_policy(model_dir, tmp_path):
    """Two adapters of different rank and modules and the base model, one after the other and
    interleaved: every answer's logprobs are its own policy's; merging again from the pristine
    base gives the same prompt logprobs bit for bit; an unloaded adapter is refused by name."""
    adapted = {
        "a": _peft_adapter(model_dir, tmp_path / "a", 4, ["q_proj", "v_proj"], seed=1),
        "b": _peft_adapter(model_dir, tmp_path / "b", 2, "all-linear", seed=2),
        None: CausalLM.from_pretrained(model_dir).double(),
    }
    engine = EmbeddedEngine(CausalLM.from_pretrained(model_dir), seed=0)
    with serve_engine(engine, lora=LoraOptions()) as (url, _):
        for name in ("a", "b"):
            loaded = httpx.post(
                f"{url}/load_lora_adapter_from_tensors", json=_load_body(tmp_path / name, name)
            )
            assert loaded.status_code == 200 and loaded.json()["success"], loaded.text
        assert sorted(loaded.json()["loaded_adapters"]) == ["a", "b"]

        answers = [
            (name, httpx.post(f"{url}/generate", json=_generate_body(name)).json())
            for name in ("a", None, "b", "a")
        ]
        for name, answer in answers:
            assert _gap(answer, adapted[name]) < 1e-4, name
            assert answer["meta_info"]["weight_version"] == "0"  # the base weights' label
            others = [_gap(answer, adapted[other]) for other in adapted if other != name]
            assert min(others) > 1e-2, (name, others)  # the adapters move the policy
        first, again = answers[0][1]["meta_info"], answers[3][1]["meta_info"]
        assert first["input_token_logprobs"] == again["input_token_logprobs"]

        async def interleaved():
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                names = ["a", "b", None, "b", "a", None]
                answers = await asyncio.gather(
                    *(http.post("/generate", json=_generate_body(n, 12)) for n in names)
                )
                return list(zip(names, (a.json() for a in answers), strict=True))

        for name, answer in asyncio.run(interleaved()):
            assert _gap(answer, adapted[name]) < 1e-4, name

        assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "a"}).json()[
            "loaded_adapters"
        ].keys() == {"b"}
        refused = httpx.post(f"{url}/generate", json=_generate_body("a"))
        assert refused.status_code == 400 and refused.json()["param"] == "lora_path"
        assert "no LoRA adapter named 'a'" in refused.json()["message"]
        assert _gap(httpx.post(f"{url}/generate", json=_generate_body(None)).json(), adapted[None]) < 1e-4


def test_requests_that_arrived_before_an_unload_finish_under_their_adapter(model_dir, tmp_path):
    """SGLang's unload lets the requests that named the adapter before it finish: one running,
    one still waiting behind a request for another adapter (arrival order). Streamed answers pass
    the same gate, and a client hanging up mid-stream leaves it open for the next request."""
    adapted = {
        name: _peft_adapter(model_dir, tmp_path / name, 2, ["q_proj"], seed)
        for name, seed in (("a", 3), ("b", 4))
    }
    adapted[None] = CausalLM.from_pretrained(model_dir).double()
    engine = EmbeddedEngine(CausalLM.from_pretrained(model_dir), seed=0)
    # Decode steps run in a worker thread: closing the gate holds the long request at its next
    # decode step (one token a row; prompts are scored past it), so the others queue behind it
    # however slow this machine is.
    gate = threading.Event()
    gate.set()

    def hold_decode(_, args) -> None:
        if args[0].shape[-1] == 1:
            gate.wait()

    engine.model.model.embed_tokens.register_forward_pre_hook(hold_decode)
    with serve_engine(engine, lora=LoraOptions()) as (url, state):

        async def streamed(http, adapter: str, hang_up: bool = False) -> dict:
            body = {**_generate_body(adapter, 40), "stream": True}
            answer = None
            async with http.stream("POST", "/generate", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        answer = json.loads(line[6:])
                        if hang_up:
                            break
            return answer

        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                for name in ("a", "b"):
                    await http.post("/load_lora_adapter_from_tensors", json=_load_body(tmp_path / name, name))
                running = asyncio.create_task(http.post("/generate", json=_generate_body("a", 400)))
                while not state.engine.running:
                    await asyncio.sleep(0.005)
                gate.clear()
                other = asyncio.create_task(http.post("/generate", json=_generate_body("b")))
                queued = asyncio.create_task(http.post("/generate", json=_generate_body("a")))
                deadline = time.monotonic() + 30
                while len(state.lora._queue) < 2:  # both wait: "b" for "a" to end, "a" behind "b"
                    assert time.monotonic() < deadline, "the others did not queue behind the long request"
                    await asyncio.sleep(0.005)
                # The unload answers while the requests under "a" are still held.
                unload = http.post("/unload_lora_adapter", json={"lora_name": "a"})
                unloaded = await asyncio.wait_for(unload, 30)
                assert not running.done()
                gate.set()
                answers = [(await task).json() for task in (running, other, queued)]
                answers.append(await streamed(http, "b"))
                await streamed(http, "b", hang_up=True)
                base = await asyncio.wait_for(http.post("/generate", json=_generate_body(None)), 30)
                return unloaded, answers, base.json()

        try:
            unloaded, answers, base = asyncio.run(run())
        finally:
            gate.set()  # a failed check must not leave the engine's thread held
    assert unloaded.status_code == 200 and len(answers[0]["output_ids"]) > 300
    for name, answer in zip(["a", "b", "a", "b"], answers, strict=True):
        assert _gap(answer, adapted[name]) < 1e-4, name
    assert len(answers[3]["output_ids"]) > 1 and _gap(base, adapted[None]) < 1e-4


def test_bad_adapters_and_requests_are_refused_by_name(model_dir, tmp_path):
    _peft_adapter(model_dir, tmp_path / "a", 4, ["q_proj", "v_proj"], seed=1)
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    tensors = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    b_key = next(k for k in tensors if ".lora_B." in k)
    renamed = {k.replace("q_proj", "foo_proj"): t for k, t in tensors.items()}
    bad = [
        ({"config_dict": {**config, "use_dora": True}}, "config_dict", "use_dora = True is not supported"),
        ({"config_dict": {**config, "r": 0}}, "config_dict", "r must be a positive integer"),
        (
            {"serialized_named_tensors": [_payload(renamed)]},
            "serialized_named_tensors",
            "the adapter names ['foo_proj'], which no linear layer of the model is called",
        ),
        (
            {"serialized_named_tensors": [_payload({k: t for k, t in tensors.items() if k != b_key})]},
            "serialized_named_tensors",
            "missing ['" + b_key.removeprefix("base_model.model.") + "']",
        ),
        (
            {"serialized_named_tensors": [_payload({**tensors, b_key: tensors[b_key][:, :2]})]},
            "serialized_named_tensors",
            "wrong shapes",
        ),
        (
            {"serialized_named_tensors": [base64.b64encode(pickle.dumps(tensors)).decode()]},
            "serialized_named_tensors",
            "bare pickle",
        ),
        ({"lora_name": "a"}, "lora_name", "already loaded"),
    ]
    engine = EmbeddedEngine(CausalLM.from_pretrained(model_dir), seed=0)
    with serve_engine(engine, lora=LoraOptions()) as (url, state):
        assert (
            httpx.post(
                f"{url}/load_lora_adapter_from_tensors", json=_load_body(tmp_path / "a", "a")
            ).status_code
            == 200
        )
        for changes, param, message in bad:
            body = (
                _load_body(tmp_path / "a", "new", **changes)
                if "lora_name" not in changes
                else _load_body(tmp_path / "a", "a")
            )
            refused = httpx.post(f"{url}/load_lora_adapter_from_tensors", json=body)
            assert refused.status_code == 400 and refused.json()["param"] == param, refused.text
            assert message in refused.json()["message"], refused.json()["message"]
        assert sorted(state.lora.adapters) == ["a"]  # nothing refused was loaded
        update = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(model_dir)})
        assert update.status_code == 400 and "--enable-lora" in update.json()["message"]
        assert httpx.post(f"{url}/generate", json=_generate_body("a")).status_code == 200  # still serving

    with serve_engine(
        EmbeddedEngine(CausalLM.from_pretrained(model_dir)), lora=LoraOptions(2, ("q_proj",))
    ) as (url, _):
        for changes, message in [
            ({}, "r = 4 exceeds the server's --max-lora-rank 2"),
            (
                {"config_dict": {**config, "r": 2}},
                "adapts ['v_proj'], outside the server's --lora-target-modules",
            ),
        ]:
            refused = httpx.post(
                f"{url}/load_lora_adapter_from_tensors", json=_load_body(tmp_path / "a", "a", **changes)
            )
            assert refused.status_code == 400 and message in refused.json()["message"], refused.text
    with serve_engine(EmbeddedEngine(CausalLM.from_pretrained(model_dir))) as (url, _):
        refused = httpx.post(f"{url}/generate", json=_generate_body("a"))
        assert refused.status_code == 400 and "LoRA is not enabled" in refused.json()["message"]
        assert (
            httpx.post(
                f"{url}/load_lora_adapter_from_tensors", json=_load_body(tmp_path / "a", "a")
            ).status_code
            == 404
        )
