"""A small real policy for AgentFlow's proxy tests: char-level ChatML codec + scripted bigram engine.

The engine is a genuine sampler: at every step it computes logits from the context, samples with
temperature and top-p from a seeded RNG, and returns ``log_softmax(logits / T)`` of the sampled
token (top-p does not renormalise, as ``SamplingParams`` states). Its logits are a fixed random
bigram table plus a ``bonus`` on the next character of a scripted reply for the current
assistant turn, so with ``top_p=0.5`` the nucleus is exactly the scripted character (its
probability is at least 0.7 with this table) while its logprob is a real, varying number. The policy is a pure
function of the token ids, so :func:`reference_logprobs` re-scores any recorded sequence.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
from collections.abc import AsyncIterator, Callable

from loong_core.protocols import SamplingParams
from loong_core.records import SpanSource, TokenSpan

SPECIALS = ["<|im_start|>", "<|im_end|>"]
CHARS = ["\n", *[chr(c) for c in range(32, 127)]]
VOCAB = SPECIALS + CHARS
IM_START, IM_END = 0, 1
_ID = {t: i for i, t in enumerate(VOCAB)}
_SPLIT = re.compile(r"(<\|im_start\|>|<\|im_end\|>)")


class CharCodec:
    """One token per printable ASCII character or newline; the two ChatML markers are one token each."""

    def encode(self, text: str) -> list[int]:
        return [
            _ID[p] if p in SPECIALS else _ID[c]
            for p in _SPLIT.split(text)
            if p
            for c in ([p] if p in SPECIALS else p)
        ]

    special_tokens = tuple(SPECIALS)

    def encode_literal(self, text: str) -> list[int]:
        return [_ID[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(VOCAB[i] for i in ids)


CODEC = CharCodec()
_HEADER = CODEC.encode("<|im_start|>assistant\n")


def assistant_turn(context: list[int]) -> tuple[int, int]:
    """(index of the current assistant turn, where its tokens start); (-1, len) outside one."""
    h = len(_HEADER)
    starts = [
        i + h for i in range(len(context) - h + 1) if context[i] == IM_START and context[i : i + h] == _HEADER
    ]
    if not starts or IM_END in context[starts[-1] :]:
        return -1, len(context)
    return len(starts) - 1, starts[-1]


class ScriptedBigramPolicy:
    """logits(context)[v] = W[last token][v] + bonus * [v == scripted next token]."""

    def __init__(
        self, script: Callable[[int], str] | list[str] | None = None, seed: int = 0, bonus: float = 9.0
    ):
        rng = random.Random(seed)
        self.table = [[rng.gauss(0.0, 1.0) for _ in VOCAB] for _ in VOCAB]
        self.script = (
            script
            if script is None or callable(script)
            else (lambda turn, s=script: s[min(turn, len(s) - 1)])
        )
        self.bonus = bonus

    def target(self, context: list[int]) -> int | None:
        if self.script is None:
            return None
        turn, start = assistant_turn(context)
        if turn < 0:
            return None
        wanted = CODEC.encode(self.script(turn) + "<|im_end|>")
        done = context[start:]
        if len(done) >= len(wanted) or wanted[: len(done)] != done:
            return None
        return wanted[len(done)]

    def logits(self, context: list[int]) -> list[float]:
        row = list(self.table[context[-1]])
        target = self.target(context)
        if target is not None:
            row[target] += self.bonus
        return row


def log_softmax(z: list[float]) -> list[float]:
    m = max(z)
    lse = m + math.log(sum(math.exp(x - m) for x in z))
    return [x - lse for x in z]


def reference_logprobs(
    policy: ScriptedBigramPolicy, ids: list[int], mask: list[int], temperature: float
) -> list[float]:
    """A fresh scoring pass over a recorded sequence: logprob of every masked token, else 0.0."""
    out = []
    for t, keep in enumerate(mask):
        if not keep:
            out.append(0.0)
            continue
        z = [x / temperature for x in policy.logits(ids[:t])]
        out.append(z[ids[t]] - math.log(math.fsum(math.exp(x) for x in z)))
    return out


class BigramEngine:
    """A RolloutEngine over :class:`ScriptedBigramPolicy`; logs every span it returns.

    ``bump_every`` > 0 advances the weight version after that many calls (weight updates between calls).
    """

    def __init__(self, policy: ScriptedBigramPolicy, seed: int = 0, bump_every: int = 0) -> None:
        self.policy, self.rng, self.bump_every = policy, random.Random(seed), bump_every
        self.version = 0
        self.log: list[tuple[list[int], TokenSpan]] = []
        self.gate: asyncio.Event | None = None

    @property
    def weight_version(self) -> int:
        return self.version

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def _sample(self, logp: list[float], top_p: float) -> int:
        order = sorted(range(len(logp)), key=lambda v: -logp[v])
        nucleus, mass = [], 0.0
        for v in order:
            nucleus.append(v)
            mass += math.exp(logp[v])
            if mass >= top_p:
                break
        r = self.rng.random() * sum(math.exp(logp[v]) for v in nucleus)
        for v in nucleus:
            r -= math.exp(logp[v])
            if r <= 0:
                return v
        return nucleus[-1]

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> TokenSpan:
        async for _ in BigramEngine.stream(self, input_ids, sampling):
            pass
        return self.log[-1][1]  # appended as the stream ended, with no await since

    async def stream(self, input_ids: list[int], sampling: SamplingParams) -> AsyncIterator[TokenSpan]:
        """The completion one token at a time, yielding to the event loop after each (and
        waiting on ``gate`` when set); the log records what was sampled, also when the caller
        stops early."""
        context, ids, lps = list(input_ids), [], []
        version = self.version
        try:
            for _ in range(sampling.max_new_tokens):
                logp = log_softmax([x / sampling.temperature for x in self.policy.logits(context)])
                tok = self._sample(logp, sampling.top_p)
                ids.append(tok)
                lps.append(logp[tok])
                context.append(tok)
                yield TokenSpan(
                    token_ids=[tok], source=SpanSource.MODEL, logprobs=[logp[tok]], weight_version=version
                )
                await asyncio.sleep(0)
                if self.gate is not None:
                    await self.gate.wait()
                if tok in sampling.stop_token_ids:
                    break
        finally:
            span = TokenSpan(token_ids=ids, source=SpanSource.MODEL, logprobs=lps, weight_version=version)
            self.log.append((list(input_ids), span))
            if self.bump_every and len(self.log) % self.bump_every == 0:
                self.version += 1


class WholeBigramEngine(BigramEngine):
    """:class:`BigramEngine` without ``stream``: the proxy gets each completion whole."""

    stream = None  # type: ignore[assignment]
