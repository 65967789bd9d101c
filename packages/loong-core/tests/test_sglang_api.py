"""SGLang HTTP API bodies: JSON round trips, bodies written by hand as SGLang documents them, and
validation errors that name the offending field."""

from __future__ import annotations

import re

import msgspec
import pytest

import loong_core.sglang_api as api
from loong_core.sglang_api import (
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    ErrorResponse,
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    GetWeightsByNameRequest,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterFromTensorsRequest,
    LoRAUpdateResponse,
    MetaInfo,
    ModelInfoResponse,
    PauseGenerationRequest,
    SGLangSamplingParams,
    StatusResponse,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightsResponse,
    WeightVersionResponse,
)

EXAMPLES = [
    SGLangSamplingParams(
        max_new_tokens=16,
        temperature=0.8,
        top_p=0.95,
        stop_token_ids=[2],
        stop=["</s>"],
        logit_bias={"5": -1.0},
        custom_params={"k": [1, "a"]},
        ignore_eos=True,
    ),
    GenerateRequest(
        input_ids=[[1, 2, 3], [4, 5]],
        sampling_params=[SGLangSamplingParams(max_new_tokens=0), SGLangSamplingParams(temperature=0.7)],
        rid=["a", "b"],
        return_logprob=True,
        logprob_start_len=1,
        top_logprobs_num=2,
    ),
    GenerateRequest(input_ids=[1, 2], sampling_params=SGLangSamplingParams(stop="</s>", top_k=5)),
    GenerateResponse(
        output_ids=[7, 8],
        meta_info=MetaInfo(
            id="r1",
            finish_reason=FinishReason(type="stop", matched=8),
            prompt_tokens=3,
            completion_tokens=2,
            weight_version="4",
            e2e_latency=0.25,
            input_token_logprobs=[(None, 1, None), (-0.5, 2, None)],
            output_token_logprobs=[(-0.1, 7, None), (-0.2, 8, "x")],
            input_top_logprobs=[None, [(-0.5, 2, None), (-1.5, 9, None)]],
        ),
    ),
    GenerateResponse(output_ids=[], meta_info=MetaInfo(finish_reason=FinishReason(type="length", length=0))),
    PauseGenerationRequest(mode="in_place"),
    ContinueGenerationRequest(),
    StatusResponse(message="Generation paused successfully."),
    WeightVersionResponse(weight_version="default"),
    ModelInfoResponse(model_path="/m", tokenizer_path="/m", weight_version="3"),
    GetWeightsByNameRequest(name="lm_head.weight", truncate_size=2),
    ErrorResponse(message="mode: bad", param="mode"),
    InitWeightsUpdateGroupRequest(
        master_address="10.0.0.1", master_port=29600, rank_offset=1, world_size=3, backend="gloo"
    ),
    UpdateWeightsFromDistributedRequest(
        names=["w", "b"],
        dtypes=["bfloat16", "bfloat16"],
        shapes=[[2, 3], [3]],
        flush_cache=False,
        weight_version="7",
        load_format="flattened_bucket",
    ),
    UpdateWeightsFromTensorRequest(serialized_named_tensors=["AAAA"], weight_version="2"),
    UpdateWeightsFromDiskRequest(model_path="/ckpt", weight_version="5"),
    DestroyWeightsUpdateGroupRequest(group_name="g"),
    UpdateWeightsResponse(success=True, message="ok", num_paused_requests=0),
    GenerateRequest(input_ids=[[1], [2]], lora_path=["v3", None]),
    LoadLoRAAdapterFromTensorsRequest(
        lora_name="v3",
        config_dict={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]},
        serialized_named_tensors=["AAAA"],
    ),
    UnloadLoRAAdapterRequest(lora_name="v2"),
    LoRAUpdateResponse(success=True, loaded_adapters={"v3": {"lora_name": "v3", "lora_path": "__tensor__"}}),
]


@pytest.mark.parametrize("record", EXAMPLES, ids=lambda r: type(r).__name__)
def test_json_round_trip_is_equal(record):
    assert msgspec.json.decode(msgspec.json.encode(record), type=type(record)) == record


def test_every_struct_has_a_round_trip_example():
    structs = {getattr(api, n) for n in api.__all__ if isinstance(getattr(api, n), type)}
    assert structs == {type(r) for r in EXAMPLES} | {FinishReason, MetaInfo}  # those two: nested


def test_sglang_documented_generate_body_decodes_into_its_fields():
    body = b"""{
        "input_ids": [[1, 2, 3], [4, 5]],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0, "top_k": null,
                            "stop_token_ids": [2], "skip_special_tokens": false},
        "return_logprob": true, "logprob_start_len": 1, "top_logprobs_num": 4,
        "stream": false, "lora_path": null
    }"""
    req = msgspec.json.decode(body, type=GenerateRequest)
    assert req.input_ids == [[1, 2, 3], [4, 5]] and req.text is None and req.rid is None
    assert (req.return_logprob, req.logprob_start_len, req.top_logprobs_num) == (True, 1, 4)
    sp = req.sampling_params
    assert isinstance(sp, SGLangSamplingParams)
    assert (sp.max_new_tokens, sp.temperature, sp.stop_token_ids) == (0, 0.0, [2])
    assert sp.value("top_k") == -1 and sp.value("top_p") == 1.0 and sp.value("max_new_tokens") == 0
    assert sp.non_default() == {"max_new_tokens": 0, "temperature": 0.0, "stop_token_ids": [2],
                                "skip_special_tokens": False}  # fmt: skip


def test_sglang_documented_generate_answer_decodes_into_its_fields():
    body = b"""{"text": "", "output_ids": [11, 2], "meta_info": {
        "id": "9f", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3,
        "weight_version": "default", "completion_tokens": 2, "cached_tokens": 1, "e2e_latency": 0.1,
        "output_token_logprobs": [[-0.25, 11, null], [-0.5, 2, null]]}}"""
    out = msgspec.json.decode(body, type=GenerateResponse)
    meta = out.meta_info
    assert out.output_ids == [11, 2] and meta.finish_reason == FinishReason(type="stop", matched=2)
    assert (meta.prompt_tokens, meta.completion_tokens, meta.cached_tokens) == (3, 2, 1)
    assert meta.output_token_logprobs == [(-0.25, 11, None), (-0.5, 2, None)]
    assert meta.input_token_logprobs is msgspec.UNSET and meta.weight_version == "default"
    assert msgspec.json.decode(
        b'{"type": "abort", "message": "x", "status_code": 503}', type=FinishReason
    ) == (FinishReason(type="abort", message="x"))


def test_sglang_documented_weight_update_bodies_decode_with_sglang_defaults():
    init = msgspec.json.decode(
        b'{"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2}',
        type=InitWeightsUpdateGroupRequest,
    )
    assert (init.group_name, init.backend) == ("weight_update_group", "nccl")
    update = msgspec.json.decode(
        b'{"names": ["w"], "dtypes": ["float32"], "shapes": [[2, 2]]}',
        type=UpdateWeightsFromDistributedRequest,
    )
    assert (update.group_name, update.flush_cache, update.abort_all_requests) == (
        "weight_update_group",
        True,
        False,
    )
    assert update.weight_version is None and update.load_format is None
    assert msgspec.json.decode(b"{}", type=PauseGenerationRequest).mode == "abort"
    refused = msgspec.json.decode(b'{"success": false, "message": "no group"}', type=UpdateWeightsResponse)
    assert not refused.success and refused.message == "no group"


def test_sglang_documented_lora_bodies_decode_with_sglang_defaults():
    load = msgspec.json.decode(
        b'{"lora_name": "a", "config_dict": {"r": 8}, "serialized_named_tensors": ["QUJD", "QUJD"]}',
        type=LoadLoRAAdapterFromTensorsRequest,
    )
    assert (load.pinned, load.load_format, len(load.serialized_named_tensors)) == (False, None, 2)
    out = msgspec.json.decode(
        b'{"success": false, "error_message": "LoRA is not enabled", "loaded_adapters": null}',
        type=LoRAUpdateResponse,
    )
    assert not out.success and out.error_message == "LoRA is not enabled"


def test_requests_carry_only_what_the_sender_set():
    """Absent sampling options take the server's preferred defaults in SGLang, so they stay absent."""
    sp = SGLangSamplingParams(max_new_tokens=4, temperature=1.0, top_p=1.0, stop_token_ids=[])
    body = msgspec.json.decode(msgspec.json.encode(GenerateRequest(input_ids=[1], sampling_params=sp)))
    assert body == {
        "input_ids": [1],
        "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "stop_token_ids": []},
    }
    assert msgspec.json.encode(ContinueGenerationRequest()) == b"{}"
    encoded = msgspec.json.decode(msgspec.json.encode(MetaInfo(id="x", output_token_logprobs=[])))
    assert "input_token_logprobs" not in encoded and encoded["completion_tokens"] == 0


def test_sampling_defaults_cover_every_option():
    assert set(api._SAMPLING_DEFAULTS) == set(SGLangSamplingParams.__struct_fields__)
    assert SGLangSamplingParams().non_default() == {}


@pytest.mark.parametrize(
    ("body", "kind", "path"),
    [
        (b'{"sampling_params": {"temperature": "hot"}}', GenerateRequest, "$.sampling_params.temperature"),
        (b'{"sampling_params": [{}, {"top_p": 1.5}]}', GenerateRequest, "$.sampling_params[1].top_p"),
        (b'{"input_ids": [[1, 2], [3, "x"]]}', GenerateRequest, "$.input_ids[1][1]"),
        (b'{"return_logprob": 1}', GenerateRequest, "$.return_logprob"),
        (b'{"top_logprobs_num": -1}', GenerateRequest, "$.top_logprobs_num"),
        (b'{"mode": "later"}', PauseGenerationRequest, "$.mode"),
        (
            b'{"names": ["w"], "dtypes": ["f"], "shapes": [[-1]]}',
            UpdateWeightsFromDistributedRequest,
            "$.shapes[0][0]",
        ),
    ],
)
def test_a_bad_type_names_the_field(body, kind, path):
    with pytest.raises(msgspec.ValidationError, match=re.escape(f"- at `{path}`")):
        msgspec.json.decode(body, type=kind)


def test_unknown_sampling_options_and_missing_fields_are_named():
    with pytest.raises(msgspec.ValidationError, match=r"unknown field `bogus` - at `\$\.sampling_params`"):
        msgspec.json.decode(b'{"sampling_params": {"bogus": 1}}', type=GenerateRequest)
    with pytest.raises(msgspec.ValidationError, match="missing required field `rank_offset`"):
        msgspec.json.decode(b'{"master_address": "h", "master_port": 1}', type=InitWeightsUpdateGroupRequest)
    assert msgspec.json.decode(b'{"input_ids": [1], "stream": false}', type=GenerateRequest).input_ids == [1]
