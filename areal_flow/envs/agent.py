"""Helpers for agent programs of ``ops.rollout(..., agent=...)`` (standard library only).

An agent program is ``agent(base_url: str, row: dict) -> float | None``: it talks to the
policy through the OpenAI-compatible endpoint at ``base_url``
(``runtime.executors.agent_endpoint``); :func:`set_reward` credits the latest policy turn
while it runs, and its return value (when not ``None``) is added to the last turn's reward.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def set_reward(base_url: str, value: float, timeout_s: float = 30.0) -> float:
    """Add ``value`` to the reward of the episode's latest policy turn.

    Args:
        base_url: the episode's base URL as the agent was given it
            (``http://127.0.0.1:<port>/episodes/<session>/v1``).
        value: a finite number.
        timeout_s: seconds to wait for the endpoint.

    Returns:
        the latest turn's reward after the addition.

    Raises:
        RuntimeError: the endpoint refused (no policy turn yet, the episode ended, a bad
            value, an unknown session), with its HTTP status and message.
    """
    url = base_url.rstrip("/")
    url = (url[: -len("/v1")] if url.endswith("/v1") else url) + "/reward"
    request = urllib.request.Request(url, data=json.dumps({"reward": value}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
    try:
        with opener.open(request, timeout=timeout_s) as response:
            return float(json.loads(response.read())["turn_reward"])
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise RuntimeError(f"set_reward({value!r}) at {url}: HTTP {exc.code}: {message}") from None
