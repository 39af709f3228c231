"""OpenAI request parsing and response bodies for the server: chat messages with `image_url`
parts become the engine's chat messages and PIL images, request fields become `SamplingParams`
keyword arguments, and every problem becomes an `ApiError` naming the field."""
from __future__ import annotations

import base64
import binascii
import io
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from PIL import Image

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*):")
# fields that change what OpenAI returns; refused unless left at their no-op value, so that a
# client never gets an answer that silently ignored what it asked for
_UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []),
                "functions": (None, []), "tool_choice": (None, "none"), "logit_bias": (None, {}),
                "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
                "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
                "response_format": (None, {"type": "text"})}


class ApiError(Exception):
    """A request the server refuses: HTTP `status` with an OpenAI-style error body."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclass
class ParsedRequest:
    """What the engine needs for one request, plus how to answer it."""

    prompt: Any                      # chat messages (HF format), a string or token ids
    images: list = field(default_factory=list)
    sampling: dict = field(default_factory=dict)   # SamplingParams keyword arguments
    caption: Any = None
    stream: bool = False
    include_usage: bool = False


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(f"malformed JSON in the request body: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _int(body: dict, name: str, low: int) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(f"{name} must be an integer, got {v!r}", name)
    if v < low:
        raise ApiError(f"{name} must be >= {low}, got {v}", name)
    return v


def _number(body: dict, name: str) -> Optional[float]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ApiError(f"{name} must be a finite number, got {v!r}", name)
    return float(v)


def _flag(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(f"{name} must be true or false, got {v!r}", name)
    return v


def check_model(body: dict, served: str):
    """Refuse a `model` other than the one served (a missing one means that one)."""
    model = body.get("model")
    if model is not None and model != served:
        raise ApiError(f"model {model!r} is not served here; this server serves {served!r}", "model")


def parse_sampling(body: dict, default_max_tokens: Optional[int]) -> dict:
    """SamplingParams keyword arguments from OpenAI's fields (OpenAI's defaults: temperature 1,
    top_p 1), plus the extensions `top_k` and `ignore_eos`."""
    for name, allowed in _UNSUPPORTED.items():
        if name in body and body[name] not in allowed:
            raise ApiError(f"{name} is not supported by this server", name)
    if _int(body, "n", 1) not in (None, 1):
        raise ApiError(f"n must be 1 (one choice per request), got {body['n']}", "n")
    kw = {"max_new_tokens": default_max_tokens, "temperature": 1.0}
    for name in ("max_tokens", "max_completion_tokens"):
        v = _int(body, name, 1)
        if v is not None:
            kw["max_new_tokens"] = v
    temperature, top_p = _number(body, "temperature"), _number(body, "top_p")
    if temperature is not None:
        if temperature < 0:
            raise ApiError(f"temperature must be >= 0 (0 = greedy), got {temperature}", "temperature")
        kw["temperature"] = temperature
    if top_p is not None:
        if not 0 < top_p <= 1:
            raise ApiError(f"top_p must be in (0, 1], got {top_p}", "top_p")
        kw["top_p"] = top_p
    for name, key in (("seed", "seed"), ("top_k", "top_k")):
        v = _int(body, name, 0)
        if v is not None:
            kw[key] = v
    if _flag(body, "ignore_eos"):
        kw["stop_at_eos"] = False
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ApiError("stop must be a non-empty string or a list of them", "stop")
        if stop:
            kw["stop"] = tuple(stop)
    return kw


def _stream_options(body: dict, req: ParsedRequest) -> ParsedRequest:
    req.stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise ApiError("stream_options must be an object", "stream_options")
        req.include_usage = _flag(opts, "include_usage")
    return req


def load_image(url: str, image_root: Optional[str]) -> Image.Image:
    """An image from a `data:` URL (base64) or a local file path (`file://` allowed, inside
    `image_root` when given). Network URLs are never fetched."""
    scheme = _SCHEME.match(url)
    scheme = scheme.group(1).lower() if scheme else ""
    if scheme == "data":
        header, sep, data = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ValueError("a data: URL must look like data:image/png;base64,<base64 data>")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"invalid base64 in the data: URL ({e})") from None
        source, what = io.BytesIO(raw), "the data: URL"
    elif scheme in ("", "file"):
        path = url[len("file://"):] if scheme == "file" else url
        real = os.path.realpath(path)
        if image_root is not None and os.path.commonpath([real, os.path.realpath(image_root)]) != \
                os.path.realpath(image_root):
            raise ValueError(f"local image {path!r} is outside the server's --image-root")
        if not os.path.isfile(real):
            raise ValueError(f"local image {path!r} does not exist on the server")
        source, what = real, f"file {path!r}"
    else:
        raise ValueError(f"{scheme}: image URLs are not fetched (the server never uses the network); "
                         "send the image as a data: URL (base64) or a local file path")
    try:
        with Image.open(source) as img:
            return img.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"{what} is not a readable image ({e})") from None


def _content(content, where: str, images: list, image_root: Optional[str]) -> list[dict]:
    """One message's content as HF parts, appending its images to `images`."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError(f"{where} must be a string or a list of content parts", where)
    parts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise ApiError(f"{at}.image_url must be {{\"url\": \"...\"}}", at)
            try:
                images.append(load_image(url, image_root))
            except ValueError as e:
                raise ApiError(f"{at}: {e}", at) from None
            parts.append({"type": "image"})
        else:
            raise ApiError(f"{at} must be a text part or an image_url part, got type {kind!r}", at)
    return parts


def parse_chat(body: dict, default_max_tokens: int, image_root: Optional[str] = None) -> ParsedRequest:
    """A /v1/chat/completions body as an engine request."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", "messages")
    req = ParsedRequest(prompt=[], sampling=parse_sampling(body, default_max_tokens))
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise ApiError(f"{where} must have a role of system, user or assistant", where)
        role = "system" if m["role"] == "developer" else m["role"]
        req.prompt.append({"role": role, "content": _content(m.get("content"), f"{where}.content",
                                                             req.images, image_root)})
    req.caption = body.get("caption")    # extension: the C view's caption(s)
    return _stream_options(body, req)


def parse_completion(body: dict, default_max_tokens: int) -> ParsedRequest:
    """A /v1/completions body (one prompt: a string or token ids; no images)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    ok = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt))
    if not ok:
        raise ApiError("prompt must be one string or one list of token ids", "prompt")
    req = ParsedRequest(prompt=prompt, sampling=parse_sampling(body, default_max_tokens))
    return _stream_options(body, req)


def submit_to_engine(engine, rid: str, req: ParsedRequest) -> None:
    """Queue a parsed request on `engine` under the id `rid` (the single-engine server and every
    data-parallel replica go through here). Input the engine refuses (ValueError / TypeError)
    becomes an ApiError (400) with the engine's message on one line."""
    from tabed_engine.config import SamplingParams

    try:
        engine.add_request(req.prompt, images=req.images or None, sampling=SamplingParams(**req.sampling),
                           caption=req.caption, request_id=rid)
    except (ValueError, TypeError) as e:
        raise ApiError(" ".join(str(e).split())) from None


def usage(out) -> dict:
    """OpenAI's usage block from a GenerationOutput."""
    p, c = out.stats.prompt_tokens, len(out.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            # prompt tokens whose prefill a cached prefix saved (OpenAI's field for prompt caching)
            "prompt_tokens_details": {"cached_tokens": out.stats.cached_tokens}}


def speculation(out) -> dict:
    """The non-standard `speculation` block: how much each target forward verified."""
    s = out.stats
    return {"speculative": s.speculative, "block_efficiency": s.block_efficiency,
            "accepted_lengths": list(s.accepted_lengths), "target_forwards": s.target_forwards}


def completion_body(rid: str, model: str, chat: bool, out) -> dict:
    """The whole (non-streamed) answer."""
    choice = {"index": 0, "finish_reason": out.finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": out.text}
    else:
        choice["text"] = out.text
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice], "usage": usage(out),
            "speculation": speculation(out)}


def chunk(rid: str, model: str, chat: bool, text: Optional[str] = None, finish: Optional[str] = None,
          role: bool = False, out=None) -> str:
    """One server-sent event of a streamed answer; `out` (the finished output) adds usage."""
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choices = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices}
    if out is not None:
        body.update(choices=[], usage=usage(out), speculation=speculation(out))
    return f"data: {json.dumps(body)}\n\n"
