"""The OpenAI-compatible endpoint that agent programs of ``ops.rollout(..., agent=...)`` call.

One loopback server (``127.0.0.1``, a free port; ``ThreadingHTTPServer`` in a daemon
thread) per :class:`~runtime.executors.episode_runner.EpisodeRunner`; each episode is a session
with base URL ``http://127.0.0.1:<port>/episodes/<session>/v1``:

* ``POST .../v1/chat/completions``: one policy turn. The first call's ``messages`` and
  ``tools`` become the prompt (chat template, ``tools=``); each later call must repeat the
  previous call's messages plus the reply it returned (role and text content compared)
  and may append new messages: only those are tokenised, as one observation
  (``Episode.observe``), so sampled ids are never re-tokenised. HTTP 400 (OpenAI error
  JSON, ``code``) otherwise, naming the first differing message index
  (``history_mismatch``); also for changed ``tools``, a call after ``max_turns`` policy
  turns (``max_turns_reached``), a context past ``max_context``
  (``context_length_exceeded``; the episode ends with ``finish_reason="length"``),
  ``n != 1`` and non-text content parts.
* ``GET .../v1/models``: the one model (the node's model name).
* ``POST /episodes/<session>/reward`` (or ``.../v1/reward``), ``{"reward": x}``: adds ``x``
  to the latest policy turn's reward (``areal_flow.envs.agent.set_reward``).

Sampling is the rollout node's, since the trainer assumes that behavior policy: a
request's ``temperature``, ``top_p``, ``stop``, ``seed``, penalties are ignored and
``model`` is not checked; ``max_tokens`` / ``max_completion_tokens`` may only lower the
node's ``max_new_tokens``. ``usage.prompt_tokens`` counts the whole context the policy
saw, ``completion_tokens`` its sampled ids (EOS included). With ``tools`` in the request
and a reply that parses as a call (``parse_tool_call``: a Hermes ``<tool_call>`` block, or
the whole reply in call syntax ``name(args)``, as env episodes accept), the message has
``tool_calls`` (that one call), ``content`` the text around a Hermes block (or ``None``)
and ``finish_reason="tool_calls"``; a malformed call attempt counts as a tool-call error.
``stream: true`` gets a minimal server-sent-event stream: the whole message, the finish
chunk, a usage chunk when ``stream_options.include_usage``, ``data: [DONE]``. Unknown or
ended sessions answer 404; internal failures 500, which the official client retries
(agents pass ``max_retries=0`` to avoid that).

Connections: HTTP/1.1 keep-alive (an episode's client sends all its calls on one
connection; a stream closes its connection), a listen backlog that takes every episode in
flight connecting at once (:data:`LISTEN_BACKLOG`), and an idle connection closed only
after ``step_timeout_s`` + :data:`KEEP_ALIVE_MARGIN_S`. A call waits for its policy turn as
long as generation takes.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from areal_flow.envs.tools import ToolCall, ToolCallError, parse_tool_call

_ROUTE = re.compile(r"^/episodes/([A-Za-z0-9_.-]+)/(v1/chat/completions|v1/models|v1/reward|reward)/?$")
_HERMES_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.S)
_REPEAT = "each call must repeat the previous call's messages plus the reply it returned"

LISTEN_BACKLOG = 4096
"""Connections the server's socket queues before it accepts them (the kernel caps it at
``net.core.somaxconn``): every episode in flight may connect at once (the arithmetic agent
example has up to ``(max_staleness + 1) * batch_size * n_samples`` = 384); Python's default
of 5 made the kernel reset connections under that load."""

KEEP_ALIVE_MARGIN_S = 30.0
"""An idle keep-alive connection is closed after the rollout's ``step_timeout_s`` + this
(seconds): never under an episode that is still within its time between policy turns."""


class EndpointError(Exception):
    """A refused request: HTTP ``status``, OpenAI error ``code``, a one-line message."""

    def __init__(self, status: int, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status, self.code = status, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": None, "code": self.code}}


@dataclass
class _Session:
    key: str
    run: object  # runtime.executors.episode_runner._Run
    lock: threading.Lock = field(default_factory=threading.Lock)
    recorded: list[dict] = field(default_factory=list)  # the conversation so far: messages + replies
    ended: str = ""  # why no further call is accepted


def _text(message: dict, i: int) -> str:
    """The text content of ``messages[i]`` (``None`` -> ``""``, text parts joined)."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        kinds = [p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content]
        bad = [k for k in kinds if k != "text"]
        if bad:
            raise EndpointError(400, f"messages[{i}]: content part of type {bad[0]!r} is not supported (text only)")
        return "".join(str(p.get("text", "")) for p in content)
    raise EndpointError(400, f"messages[{i}].content: a string or a list of text parts, got {type(content).__name__}")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise EndpointError(400, "messages: a non-empty list of chat messages is required")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise EndpointError(400, f"messages[{i}]: a chat message needs a string role, got {m!r:.80}")
        out.append({**{k: v for k, v in m.items() if v is not None}, "content": _text(m, i)})
    return out


def _new_messages(recorded: list[dict], msgs: list[dict]) -> list[dict]:
    """``msgs`` after the ``recorded`` conversation, which it must repeat (role, content)."""
    for i, old in enumerate(recorded):
        if i >= len(msgs):
            raise EndpointError(400, f"messages has {len(msgs)} messages but the episode's conversation has "
                                f"{len(recorded)}: message {i} ({old['role']}) is missing; {_REPEAT}",
                                "history_mismatch")
        new = msgs[i]
        if (new["role"], new["content"]) != (old["role"], old["content"]):
            raise EndpointError(400, f"messages[{i}] does not extend the episode's conversation: expected role "
                                f"{old['role']!r} content {old['content']!r:.80}, got role {new['role']!r} content "
                                f"{new['content']!r:.80}; {_REPEAT}", "history_mismatch")
    return msgs[len(recorded):]


def _budget(body: dict, node_max: int) -> int:
    """Tokens this turn may sample: the node's ``max_new_tokens``, lowered by the request's."""
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is None:
        return node_max
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise EndpointError(400, f"max_tokens={limit!r}: a positive integer is required")
    return min(node_max, limit)


def _reply(text: str, tools: list | None, finish: str) -> tuple[dict, str, ToolCall | ToolCallError | None]:
    """The assistant message, the finish reason and the parsed call (``None`` without tools)."""
    if not tools:
        return {"role": "assistant", "content": text}, finish, None
    call = parse_tool_call(text, tools)
    if not isinstance(call, ToolCall):
        return {"role": "assistant", "content": text}, finish, call
    rest = _HERMES_BLOCK.sub("", text).strip() if "<tool_call>" in text else ""
    spec = {"name": call.name, "arguments": json.dumps(call.arguments)}
    return ({"role": "assistant", "content": rest or None,
             "tool_calls": [{"id": f"call_{secrets.token_hex(8)}", "type": "function", "function": spec}]},
            "tool_calls", call)


class AgentEndpoint:
    """Serves agent sessions of ``runner``'s episodes (module doc); starts its server now.

    Args:
        runner: the :class:`~runtime.executors.episode_runner.EpisodeRunner` (``_policy_turn``,
            ``params``, ``attrs["max_turns"]``, ``max_context``).
        model: the model name ``/v1/models`` lists and completions report.
    """

    def __init__(self, runner, model: str = "policy") -> None:
        self.runner, self.model = runner, model
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        idle_s = float(getattr(runner, "attrs", {}).get("step_timeout_s", 30.0)) + KEEP_ALIVE_MARGIN_S
        self._server = _Server(("127.0.0.1", 0), type("_Bound", (_Handler,), {"endpoint": self, "timeout": idle_s}))
        self.port = int(self._server.server_address[1])
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True,
                         name=f"agent-endpoint:{self.port}").start()

    def open(self, run) -> tuple[str, str]:
        """A session for episode ``run``: ``(session key, base URL)``."""
        key = f"{run.index}.{run.sample}.{run.attempt}-{secrets.token_hex(6)}"
        with self._lock:
            self._sessions[key] = _Session(key, run)
        return key, f"http://127.0.0.1:{self.port}/episodes/{key}/v1"

    def end(self, key: str) -> None:
        """End session ``key`` (later requests get 404); waits for a call in flight."""
        with self._lock:
            session = self._sessions.pop(key, None)
        if session is not None:
            with session.lock:
                session.ended = "the episode ended"

    def close(self) -> None:
        """Stop the server (sessions end; their next request fails to connect)."""
        with self._lock:
            self._sessions.clear()
        self._server.shutdown()
        self._server.server_close()

    def _session(self, key: str) -> _Session:
        with self._lock:
            session = self._sessions.get(key)
        if session is None:
            raise EndpointError(404, f"no episode session {key!r} (unknown, or its episode ended)", "not_found")
        return session

    @staticmethod
    def _live(session: _Session) -> None:
        if session.run.failed or session.ended:
            raise EndpointError(400, f"episode session {session.key} ended: {session.run.failed or session.ended}",
                                "episode_ended")

    def models(self, key: str) -> dict:
        self._session(key)
        model = {"id": self.model, "object": "model", "created": 0, "owned_by": "areal-flow"}
        return {"object": "list", "data": [model]}

    def reward(self, key: str, body: dict) -> dict:
        """Add ``body["reward"]`` to the latest turn's reward; ``{"turn", "turn_reward"}``."""
        session = self._session(key)
        value = body.get("reward")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise EndpointError(400, f"reward={value!r}: a finite number is required")
        with session.lock:
            self._live(session)
            episode = session.run.episode
            if not episode.turn_rewards:
                raise EndpointError(400, "a reward before the policy's first turn: make a chat completion call first")
            episode.reward(float(value))
            return {"object": "reward", "turn": episode.n_turns - 1, "turn_reward": episode.turn_rewards[-1]}

    def chat(self, key: str, body: dict) -> dict:
        """One policy turn of session ``key`` (module doc); the ``chat.completion`` dict."""
        session = self._session(key)
        runner = self.runner
        with session.lock:
            self._live(session)
            run, episode = session.run, session.run.episode
            if (body.get("n") or 1) != 1:
                raise EndpointError(400, f"n={body.get('n')!r}: one choice per call (n=1)")
            budget = _budget(body, runner.params.max_new_tokens)
            msgs, tools = _messages(body), body.get("tools") or None
            if episode.n_turns >= runner.attrs["max_turns"]:
                raise EndpointError(400, f"max_turns reached: the episode had its {episode.n_turns} policy turns",
                                    "max_turns_reached")
            if session.recorded and tools != episode.tools:
                raise EndpointError(400, "tools differ from the episode's first call: the tool list is part of the "
                                    "prompt and cannot change", "history_mismatch")
            new = _new_messages(session.recorded, msgs)
            if not session.recorded:
                episode.tools = tools
            try:
                episode.observe(new)
            except Exception as exc:  # the chat template or the tokenizer refused the messages
                raise EndpointError(400, f"the chat template could not render messages[{len(session.recorded)}:]: "
                                    f"{type(exc).__name__}: {exc}") from exc
            session.recorded = msgs
            ids = episode.context_ids
            if len(ids) >= runner.max_context - 1:
                episode.finish_reason = "length"
                session.ended = f"context length reached ({len(ids)} of max_context={runner.max_context} tokens)"
                raise EndpointError(400, session.ended, "context_length_exceeded")
            try:
                result = runner._policy_turn(run, ids, budget)
            except Exception as exc:  # _Abandoned: the episode failed while its turn was sampled
                raise EndpointError(400, f"episode session {key} ended: {run.failed or exc}", "episode_ended") from exc
            run.phase, run.since = "env", time.monotonic()  # the agent's own time starts now
            text = result.output_text.strip()
            episode.act(result.output_ids, result.behavior_logprobs, result.versions, text, result.finish_reason)
            message, finish, call = _reply(text, tools, result.finish_reason)
            if isinstance(call, ToolCallError) and call.is_call_attempt:
                run.tool_errors += 1
            session.recorded = msgs + [{"role": "assistant", "content": message["content"] or ""}]
            n_prompt, n_out = len(ids), len(result.output_ids)
            return {"id": f"chatcmpl-{key}-{episode.n_turns - 1}", "object": "chat.completion",
                    "created": int(time.time()), "model": self.model,
                    "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
                    "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                              "total_tokens": n_prompt + n_out}}


def _body(raw: bytes) -> dict:
    """The request body as a JSON object. Raises EndpointError (400) otherwise."""
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EndpointError(400, f"the request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise EndpointError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _chunks(completion: dict, include_usage: bool) -> list[dict]:
    """``completion`` as ``chat.completion.chunk`` events: the message, the finish, usage."""
    head = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    choice = completion["choices"][0]
    delta = dict(choice["message"])
    if "tool_calls" in delta:
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(delta["tool_calls"])]
    out = [{**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]},
           {**head, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}]}]
    if include_usage:
        out.append({**head, "choices": [], "usage": completion["usage"]})
    return out


class _Server(ThreadingHTTPServer):
    """One thread per connection; a listen backlog that holds every episode's connect at once."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG


class _Handler(BaseHTTPRequestHandler):
    """Routes requests to ``endpoint`` (set on a subclass per server, with ``timeout``: seconds
    an idle keep-alive connection is held); HTTP/1.1, so an episode's client sends all its
    calls on one connection."""

    endpoint: AgentEndpoint
    server_version = "areal-flow-agent-endpoint/1"
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        pass  # no access log on the worker's stderr

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        try:
            raw = self._read_body()  # first, whatever the answer: the connection carries the next request
            match = _ROUTE.match(self.path.split("?", 1)[0])
            if match is None:
                raise EndpointError(404, f"no route {method} {self.path}: use /episodes/<session>/v1/chat/completions, "
                                    "/episodes/<session>/v1/models or /episodes/<session>/reward", "not_found")
            key, route = match.groups()
            if route == "v1/models":
                if method != "GET":
                    raise EndpointError(405, f"{method} {self.path}: use GET", "method_not_allowed")
                return self._json(200, self.endpoint.models(key))
            if method != "POST":
                raise EndpointError(405, f"{method} {self.path}: use POST", "method_not_allowed")
            body = _body(raw)
            if route == "v1/chat/completions":
                out = self.endpoint.chat(key, body)
                if body.get("stream"):
                    return self._stream(_chunks(out, bool((body.get("stream_options") or {}).get("include_usage"))))
                return self._json(200, out)
            return self._json(200, self.endpoint.reward(key, body))
        except EndpointError as exc:
            self._json(exc.status, exc.body())
        except Exception as exc:  # a bug here must answer the agent, not hang it
            self._json(500, EndpointError(500, f"{type(exc).__name__}: {exc}", "internal_error").body())

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length") or "0"
        if not length.isdigit():
            self.close_connection = True  # where the next request starts is unknown
            raise EndpointError(400, f"Content-Length: {length!r:.40} is not a byte count")
        return self.rfile.read(int(length))

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, events: list[dict]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # no length: the stream ends with the connection
        self.close_connection = True
        self.end_headers()
        for event in events:
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
