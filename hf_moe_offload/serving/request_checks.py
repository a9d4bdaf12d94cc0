"""Requests with a malformed field get a 400 in OpenAI's error shape, naming the field, before transformers serve
builds anything from them (it raised a 500 for them: a `ValueError`, `TypeError` or `KeyError` from deep inside).

Only what the OpenAI API defines and transformers would fail on is checked: the chat messages, the token limits,
`temperature`, `top_p` and `stop`. Everything else goes through unchanged, as does any body that is not a JSON
object (FastAPI answers that one with its own 422).

Example:
    >>> request_problem("/v1/chat/completions", {"messages": [], "max_tokens": 8})
    'messages must be a non-empty list of {"role": ..., "content": ...} objects'
    >>> request_problem("/v1/completions", {"prompt": "Hi", "max_tokens": 0})
    'max_tokens must be an integer >= 1, got 0'
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

CHECKED_ROUTES = ("/v1/chat/completions", "/v1/completions")


def request_problem(path: str, body: Any) -> str | None:
    """What is wrong with the JSON `body` sent to `path`, or None."""
    if not isinstance(body, dict):
        return None
    if path == "/v1/chat/completions":
        problem = _messages_problem(body.get("messages"))
        if problem:
            return problem
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return f"{key} must be an integer >= 1, got {value!r}"
    for key, low, high in (("temperature", 0.0, None), ("top_p", 0.0, 1.0)):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < low
                                  or (high is not None and value > high)):
            allowed = f">= {low:g}" if high is None else f"between {low:g} and {high:g}"
            return f"{key} must be a number {allowed}, got {value!r}"
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or isinstance(stop, list)
                                 and all(isinstance(s, str) for s in stop)):
        return f"stop must be a string or a list of strings, got {stop!r}"
    return None


def _messages_problem(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return 'messages must be a non-empty list of {"role": ..., "content": ...} objects'
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f'messages[{i}] must be an object with a string "role", got {message!r}'
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            return f"messages[{i}].content must be a string or a list of content parts, got {content!r}"
    return None


class CheckedRequests:
    """ASGI middleware: a POST to a checked route whose body has a problem gets the 400; any other request, and a
    checked one without problems, reaches the app with its body replayed and later messages (a client's
    disconnect) passed through."""

    def __init__(self, app: Callable[..., Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in CHECKED_ROUTES:
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":        # the client left before sending its body
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            problem = request_problem(scope["path"], json.loads(body))
        except ValueError:
            problem = None                                 # not JSON: FastAPI's own 422
        if problem is not None:
            await _send_400(send, problem)
            return
        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)


def _replay(messages: list[dict], receive: Callable) -> Callable:
    pending = list(messages)

    async def replayed() -> dict:
        return pending.pop(0) if pending else await receive()
    return replayed


async def _send_400(send: Callable, problem: str) -> None:
    payload = json.dumps({"error": {"message": problem, "type": "invalid_request_error", "param": None,
                                    "code": None}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
