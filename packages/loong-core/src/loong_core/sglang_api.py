"""SGLang's native HTTP API as msgspec Structs: the bodies Loong's clients send to an SGLang server
and Loong's embedded SGLang-compatible server reads and answers.

Field names, types and defaults are SGLang's own (``managers/io_struct.py``,
``sampling/sampling_params.py`` and ``entrypoints/http_server.py`` in sgl-project/sglang). The
subset Loong speaks: token ids in and out (SGLang started with ``--skip-tokenizer-init``), and one
value per request for ``return_logprob``, ``logprob_start_len`` and ``top_logprobs_num`` (SGLang
also takes a list with one value per prompt).

Requests omit their defaults when encoded (``omit_defaults``), so a body carries exactly what its
sender set. Absent is not the same as default for sampling options: SGLang fills an absent option
from the server's ``preferred_sampling_params`` (the model's generation config, say) before its
documented default, so a client that wants ``temperature = 1.0`` must send it. Every sampling
option therefore defaults to ``None``; a reader takes ``None`` (absent or ``null``) as SGLang's
default, as SGLang's own ``SamplingParams.__post_init__`` does (:meth:`SGLangSamplingParams.value`).

Unknown fields are ignored on decode, as SGLang ignores the many request fields Loong never reads,
except in :class:`SGLangSamplingParams`: SGLang builds its sampling parameters from that object by
keyword, so a misspelled option is an error there too. Responses encode every field except those
left ``UNSET`` (absent from the body, as SGLang leaves them out).

A logprob entry is SGLang's ``[logprob, token_id, text]`` triple (:data:`LogprobEntry`): ``logprob``
is ``null`` for the first scored prompt token (nothing to condition on), ``text`` is ``null``
unless the request asked for ``return_text_in_logprobs``.

Round trip: ``msgspec.json.decode(msgspec.json.encode(x), type=type(x)) == x`` for every struct.
A ``msgspec.ValidationError`` names the offending field by its path
(``Expected `float | null`, got `str` - at `$.sampling_params.temperature```).

Example::

    body = msgspec.json.encode(
        GenerateRequest(input_ids=[1, 2, 3], sampling_params=SGLangSamplingParams(max_new_tokens=8),
                        return_logprob=True))
    out = msgspec.json.decode(response_bytes, type=GenerateResponse)
    logprobs = [lp for lp, _, _ in out.meta_info.output_token_logprobs]
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

__all__ = [
    # /generate
    "FinishReason",
    "GenerateRequest",
    "GenerateResponse",
    "LogprobEntry",
    "MetaInfo",
    "SGLangSamplingParams",
    # generation control and server state
    "ContinueGenerationRequest",
    "ErrorResponse",
    "GetWeightsByNameRequest",
    "ModelInfoResponse",
    "PauseGenerationRequest",
    "StatusResponse",
    "WeightVersionResponse",
    # weight updates
    "DestroyWeightsUpdateGroupRequest",
    "InitWeightsUpdateGroupRequest",
    "UpdateWeightsFromDiskRequest",
    "UpdateWeightsFromDistributedRequest",
    "UpdateWeightsFromTensorRequest",
    "UpdateWeightsResponse",
    # LoRA adapters
    "LoRAUpdateResponse",
    "LoadLoRAAdapterFromTensorsRequest",
    "UnloadLoRAAdapterRequest",
]

LogprobEntry = tuple[float | None, int, str | None]
"""``[logprob, token_id, text]``; see the module docstring."""

_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_GROUP = "weight_update_group"


class _Request(msgspec.Struct, frozen=True, omit_defaults=True):
    """A request body: defaults are left out when encoded."""


class _Response(msgspec.Struct, frozen=True):
    """A response body: every field is encoded except ``UNSET`` ones."""


# ---- /generate ----

_SAMPLING_DEFAULTS = MappingProxyType(
    {
        "max_new_tokens": 128, "stop": None, "stop_token_ids": None, "stop_regex": None,
        "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
        "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1,
        "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
        "ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
        "no_stop_trim": False, "custom_params": None, "stream_interval": None, "logit_bias": None,
        "sampling_seed": None,
    }
)  # fmt: skip


class SGLangSamplingParams(_Request, forbid_unknown_fields=True):
    """``sampling_params`` of ``/generate``: every SGLang option, ``None`` meaning SGLang's default.

    Defaults (SGLang's): ``max_new_tokens = 128``, ``temperature = 1.0``, ``top_p = 1.0``,
    ``top_k = -1`` (whole vocabulary), ``min_p = 0``, penalties 0 (``repetition_penalty = 1``),
    ``min_new_tokens = 0``, ``n = 1``, ``skip_special_tokens`` and
    ``spaces_between_special_tokens`` true, every other flag false and every other option unset.
    ``temperature = 0`` is greedy in SGLang. Decoding checks SGLang's ranges for the options that
    have one here: ``max_new_tokens >= 0`` (0: prefill only), ``temperature >= 0``,
    ``0 < top_p <= 1``.
    """

    max_new_tokens: _NonNegative | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None

    def value(self, name: str) -> Any:
        """Option ``name`` as SGLang reads it: the value sent, or SGLang's default when ``None``."""
        sent = getattr(self, name)
        return _SAMPLING_DEFAULTS[name] if sent is None else sent

    def non_default(self) -> dict[str, Any]:
        """The options sent with a value other than SGLang's default, by name."""
        sent = {name: getattr(self, name) for name in self.__struct_fields__}
        return {k: v for k, v in sent.items() if v is not None and v != _SAMPLING_DEFAULTS[k]}


class GenerateRequest(_Request):
    """``POST /generate``.

    ``input_ids``: one prompt (``list[int]``) or a batch (``list[list[int]]``); the type admits a
    mix, which a server refuses. ``text`` is SGLang's alternative to ``input_ids``.
    ``sampling_params``: one object for every prompt or a list with one per prompt.
    ``return_logprob`` (default false) adds ``output_token_logprobs`` and
    ``input_token_logprobs`` for ``input_ids[logprob_start_len:]`` (default ``-1``: the last
    prompt token only); ``top_logprobs_num = k`` (default 0) adds the ``k`` best entries per
    position. ``rid``: request id, one per prompt for a batch. ``stream``: answer with server-sent
    events, each a :class:`GenerateResponse` of the answer so far (``output_ids`` and logprobs
    cumulative, SGLang's default), ``finish_reason`` set on the last, then ``data: [DONE]``.
    ``lora_path``: the name of a loaded LoRA adapter to sample with (one per prompt for a batch;
    ``None``: the base model), as ``/load_lora_adapter_from_tensors`` named it.
    """

    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    sampling_params: SGLangSamplingParams | list[SGLangSamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: _NonNegative | None = None
    stream: bool | None = None
    lora_path: str | list[str | None] | None = None


class FinishReason(_Response):
    """``meta_info.finish_reason``: ``{"type": "length", "length": n}``, ``{"type": "stop",
    "matched": token_id_or_string}`` or ``{"type": "abort", "message": ...}``."""

    type: str
    length: int | UnsetType = UNSET
    matched: int | str | UnsetType = UNSET
    message: str | UnsetType = UNSET


class MetaInfo(_Response):
    """``meta_info`` of one ``/generate`` answer.

    Invariants: ``[t[1] for t in output_token_logprobs] == output_ids``; ``input_token_logprobs``
    covers ``input_ids[start:]`` (``start`` the request's ``logprob_start_len``) and its entry ``i``
    is ``log p(x[start+i] | x[:start+i])``; ``input_top_logprobs``, when asked for, has one entry
    per ``input_token_logprobs`` entry (``None`` or empty where there is no logprob), most likely
    first; ``output_top_logprobs`` likewise one entry per output token. The logprob lists are
    ``UNSET`` unless the request set ``return_logprob`` (the top ones: and ``top_logprobs_num``).
    ``weight_version`` is SGLang's label, ``"default"`` before the first update.
    """

    id: str = ""
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str | None = None
    e2e_latency: float = 0.0
    input_token_logprobs: list[LogprobEntry] | UnsetType = UNSET
    output_token_logprobs: list[LogprobEntry] | UnsetType = UNSET
    input_top_logprobs: list[list[LogprobEntry] | None] | UnsetType = UNSET
    output_top_logprobs: list[list[LogprobEntry] | None] | UnsetType = UNSET


class GenerateResponse(_Response):
    """One prompt's answer; a batch request is answered with a JSON list of these, in order."""

    output_ids: list[int]
    meta_info: MetaInfo


# ---- generation control and server state ----


class PauseGenerationRequest(_Request):
    """``POST /pause_generation``: ``abort`` returns running requests early, ``retract`` re-queues
    them (their KV is recomputed), ``in_place`` keeps them with their KV cache."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationRequest(_Request):
    """``POST /continue_generation``: no fields (the body is ``{}``)."""


class StatusResponse(_Response):
    """The answer of ``/pause_generation`` and ``/continue_generation``."""

    message: str
    status: str = "ok"


class WeightVersionResponse(_Response):
    """``GET /get_weight_version``."""

    weight_version: str | None = None


class ModelInfoResponse(_Response):
    """``GET /get_model_info``."""

    model_path: str
    tokenizer_path: str | None = None
    is_generation: bool = True
    preferred_sampling_params: dict[str, Any] | None = None
    weight_version: str | None = None


class GetWeightsByNameRequest(_Request):
    """``POST /get_weights_by_name``: the first ``truncate_size`` rows of parameter ``name``
    (answered with a bare nested JSON list)."""

    name: str
    truncate_size: int = 100


class ErrorResponse(_Response):
    """An error body: SGLang's (``object``, ``message``, ``type``, ``param``, ``code``) plus
    ``success: false``, so that a refusal reads like SGLang's weight-update refusals
    (``{"success": false, "message": ...}``, which decode as :class:`UpdateWeightsResponse`)."""

    message: str
    success: bool = False
    object: str = "error"
    type: str = "BadRequestError"
    param: str | None = None
    code: int = 400


# ---- weight updates ----


class InitWeightsUpdateGroupRequest(_Request):
    """``POST /init_weights_update_group``: the server's ranks join the ``torch.distributed`` group
    hosted at ``master_address:master_port`` as ranks ``rank_offset ..`` of ``world_size``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = _GROUP
    backend: str = "nccl"


class UpdateWeightsFromDistributedRequest(_Request):
    """``POST /update_weights_from_distributed``: receive tensors broadcast from rank 0 of
    ``group_name`` during the call.

    Invariant: ``len(names) == len(dtypes) == len(shapes)``. ``dtypes`` are torch dtype names
    (``"bfloat16"``). ``load_format``: ``None`` (one broadcast per tensor, in ``names`` order) or
    ``"flattened_bucket"`` (one broadcast of the flattened tensors back to back).
    ``weight_version``: the label the server reports once the update applied.
    """

    names: list[str]
    dtypes: list[str]
    shapes: list[list[_NonNegative]]
    group_name: str = _GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class UpdateWeightsFromTensorRequest(_Request):
    """``POST /update_weights_from_tensor``: tensors serialized in the body (SGLang: one
    ``MultiprocessingSerializer`` payload per tensor-parallel rank)."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class UpdateWeightsFromDiskRequest(_Request):
    """``POST /update_weights_from_disk``: load the checkpoint directory ``model_path``."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class DestroyWeightsUpdateGroupRequest(_Request):
    """``POST /destroy_weights_update_group``."""

    group_name: str = _GROUP


class UpdateWeightsResponse(_Response):
    """The answer of the weight-update and group endpoints (HTTP 400 with ``success: false`` when
    refused). ``num_paused_requests`` comes with ``/update_weights_from_disk`` only."""

    success: bool
    message: str = ""
    num_paused_requests: int | UnsetType = UNSET


# ---- LoRA adapters (a server started with --enable-lora) ----


class LoadLoRAAdapterFromTensorsRequest(_Request):
    """``POST /load_lora_adapter_from_tensors``: serve a LoRA adapter under ``lora_name``.

    ``config_dict``: the adapter's PEFT ``adapter_config.json`` (``r``, ``lora_alpha``,
    ``target_modules``, ...). ``serialized_named_tensors``: one payload per tensor-parallel rank,
    each base64 of a ``{name: tensor}`` dict with PEFT's names
    (``base_model.model.<module>.lora_A.weight``); SGLang sends ``MultiprocessingSerializer``
    pickles (CUDA IPC handles), as for ``/update_weights_from_tensor``. SGLang before 0.5.18 took
    one payload in ``serialized_tensors`` instead. A name already loaded is refused.
    """

    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: list[str]
    pinned: bool = False
    load_format: str | None = None


class UnloadLoRAAdapterRequest(_Request):
    """``POST /unload_lora_adapter``: new requests can no longer name ``lora_name``; it is freed
    once the requests already using it have ended."""

    lora_name: str


class LoRAUpdateResponse(_Response):
    """The answer of the adapter endpoints (HTTP 400 with ``success: false`` when refused).
    ``loaded_adapters``: every adapter served afterwards, by name."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, Any] | None = None
