"""An OpenAI-compatible chat endpoint on 127.0.0.1, served by the rollout engine while a rollout runs.

An agent written against the OpenAI chat API (the ``openai`` client, any HTTP client) talks to
``http://127.0.0.1:<port>/v1``; its API key names its episode. Each ``POST /v1/chat/completions`` waits in
the handler's thread while the rollout's runner (:mod:`~yatt_lightning.agents.endpoint`) turns the
messages into token ids, has the engine sample the reply and records the turn; the reply comes back in
the API's format. ``GET /v1/models`` lists the one model. Only the server's own threads touch HTTP; the
engine is driven by the runner alone.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "yatt-policy"


@dataclass
class ChatRequest:
    """One request of an episode, waiting for its reply (``reply`` is set, then ``done``)."""

    episode: str
    messages: list[dict]
    max_tokens: int | None
    reply: dict | None = None
    error: tuple[int, str] | None = None
    done: threading.Event = field(default_factory=threading.Event)


class ChatServer:
    """The endpoint; requests go to :attr:`requests` (a queue the runner reads).

    Args:
        timeout_s: How long a request waits for its reply before it is answered with an error (504).
    """

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.requests: queue.Queue[ChatRequest] = queue.Queue()
        self.timeout_s = timeout_s
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # no access log on stderr
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                if self.path.rstrip("/") == "/v1/models":
                    return self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "yatt"}]})
                self._send(404, _error(f"no route {self.path}"))

            def do_POST(self) -> None:  # noqa: N802
                if self.path.rstrip("/") != "/v1/chat/completions":
                    return self._send(404, _error(f"no route {self.path}"))
                key = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                    messages = body["messages"]
                    if not isinstance(messages, list) or not messages:
                        raise ValueError("`messages` must be a non-empty list")
                except (ValueError, KeyError) as err:
                    return self._send(400, _error(f"bad request: {err}"))
                if body.get("stream"):
                    return self._send(400, _error("streaming is not supported"))
                request = ChatRequest(key, messages, body.get("max_tokens") or body.get("max_completion_tokens"))
                server.requests.put(request)
                if not request.done.wait(server.timeout_s):
                    return self._send(504, _error(f"no reply within {server.timeout_s:g} s"))
                if request.error is not None:
                    return self._send(request.error[0], _error(request.error[1]))
                self._send(200, request.reply)

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(target=self._http.serve_forever, name="yatt-openai-endpoint", daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


def reply(text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
    """A ``chat.completion`` object in the OpenAI API's format."""
    return {
        "id": f"chatcmpl-yatt-{time.monotonic_ns()}", "object": "chat.completion", "created": int(time.time()),
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": "stop" if finish_reason == "stop" else "length", "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }  # fmt: skip


def _error(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error"}}
