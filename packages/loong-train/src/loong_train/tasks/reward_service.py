"""``[reward] url``: a reward service over HTTP, called like a reward function.

One JSON ``POST`` per episode holding the reward parameters, ``Authorization: Bearer <key>``
from ``api_key_env``, retries on refused connections, timeouts and 5xx answers; the protocol is
documented with the ``[reward]`` table in :mod:`loong_train.tasks.reward`.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

from loong_core.config import ConfigError
from loong_train.tasks.config import RewardConfig

__all__ = ["RewardService"]


class RewardService:
    """``[reward] url``: one JSON ``POST`` per episode, retried on connection errors, timeouts
    and 5xx answers (see :mod:`loong_train.tasks.reward`). Called like a reward function, by keyword."""

    def __init__(self, config: RewardConfig) -> None:
        self.url, self.timeout_s, self.retries = config.url, config.timeout_s, config.retries
        self.headers = {"Content-Type": "application/json"}
        if config.api_key_env:
            key = os.environ.get(config.api_key_env)
            if not key:
                raise ConfigError(
                    f"reward.api_key_env names {config.api_key_env!r}, which is not set in the environment"
                )
            self.headers["Authorization"] = f"Bearer {key}"

    def __call__(self, **arguments: Any) -> Any:
        body = json.dumps(arguments, default=str).encode()
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    text = response.read()
                break
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode(errors="replace")
                if e.code < 500 or attempt == self.retries:
                    raise RuntimeError(f"reward service {self.url} answered {e.code}: {detail}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                if attempt == self.retries:
                    raise RuntimeError(
                        f"reward service {self.url} failed {self.retries + 1} times, last: {e}"
                    ) from None
            time.sleep(0.5 * 2**attempt)
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"reward service {self.url} answered {text[:200]!r}, not JSON") from None
