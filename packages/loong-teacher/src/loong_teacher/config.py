"""The Teacher Manager's configuration: one Struct per teacher backend (picked by ``type``) and the
manager's own. Pure msgspec: importing it loads no torch, so a recipe that lists teachers validates
without the backends."""

from __future__ import annotations

from typing import Literal

import msgspec

from loong_teacher.compat import TokenizerMapping

__all__ = [
    "LocalTeacherConfig",
    "SGLangTeacherConfig",
    "TeacherConfig",
    "TeacherConfigBase",
    "TeacherManagerConfig",
]


class TeacherConfigBase(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Fields every teacher has, whatever its backend.

    - ``name``: unique among the manager's teachers (metrics and ``TeacherScores.teacher`` use it).
    - ``tags``: values of the samples' routing tag (``TeacherManagerConfig.route_tag``) sent here.
    - ``coefficient``: this teacher's KL coefficient (lambda of the reverse-KL advantage).
    - ``tokenizer_mapping``: a reviewed student/teacher tokenizer difference (see :mod:`loong_teacher.compat`);
      student ids are translated before scoring and top-k ids translated back.
    """

    name: str
    tags: list[str] = []
    coefficient: float = 1.0
    tokenizer_mapping: TokenizerMapping | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a teacher needs a non-empty name")
        if self.coefficient < 0:
            raise ValueError(f"teacher {self.name!r}: coefficient must be >= 0, got {self.coefficient}")


class LocalTeacherConfig(TeacherConfigBase, tag="local", tag_field="type"):
    """``type = "local"``: ``path`` to a Hugging Face checkpoint directory; ``device`` (``cpu``,
    ``cuda``, ``cuda:1``); ``dtype`` every floating tensor is cast to; ``max_batch_tokens``: padded
    tokens per forward pass."""

    path: str
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_batch_tokens: int = 8192

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_batch_tokens < 1:
            raise ValueError(f"teacher {self.name!r}: max_batch_tokens must be >= 1")


class SGLangTeacherConfig(TeacherConfigBase, tag="sglang", tag_field="type"):
    """``type = "sglang"``: ``url`` of the server; ``batch_size`` rows per request; ``timeout_s`` per
    request; ``retries`` after a transient failure, waiting ``backoff_s`` doubling each time."""

    url: str
    api_key: str | None = None
    batch_size: int = 32
    max_concurrency: int = 4
    timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    retries: int = 3
    backoff_s: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(
                f"teacher {self.name!r}: url must start with http:// or https://, got {self.url!r}"
            )
        if self.batch_size < 1 or self.max_concurrency < 1 or self.retries < 0 or self.timeout_s <= 0:
            raise ValueError(
                f"teacher {self.name!r}: batch_size and max_concurrency must be >= 1, retries >= 0, timeout_s > 0"
            )


TeacherConfig = LocalTeacherConfig | SGLangTeacherConfig


class TeacherManagerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``teachers`` (each with a ``type``); ``route_tag``: the sample tag whose value picks a teacher;
    ``default``: the teacher of samples no teacher claims (``""``: such a sample is an error);
    ``budget_bytes``: resident local teachers' bytes (``None``: no limit); ``top_k``: top-k to return."""

    teachers: list[TeacherConfig]
    route_tag: str = "domain"
    default: str = ""
    budget_bytes: int | None = None
    top_k: int = 0

    def __post_init__(self) -> None:
        names = [t.name for t in self.teachers]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"teachers need unique names and at least one teacher, got {names}")
        if self.default and self.default not in names:
            raise ValueError(f"default teacher {self.default!r} is not one of {names}")
        claimed: dict[str, str] = {}
        for t in self.teachers:
            for tag in t.tags:
                if claimed.setdefault(tag, t.name) != t.name:
                    raise ValueError(f"tag {tag!r} is routed to both {claimed[tag]!r} and {t.name!r}")
        if self.top_k < 0 or (self.budget_bytes is not None and self.budget_bytes <= 0):
            raise ValueError("top_k must be >= 0 and budget_bytes > 0")
