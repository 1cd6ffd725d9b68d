"""OpenAI-compatible requests, and vLLM's P/D parameters: strict parsing (no I/O).

Each parser takes a decoded JSON body -- any JSON value -- and returns a
checked :class:`GenerationRequest` or raises :class:`~.errors.HTTPError`: a
4xx whose ``param`` names the field, never another exception (the tests fuzz
this). The policy, field by field (``docs/serving.md`` has the table):

* fields with a meaning here are checked and used (``prompt``/``messages``,
  ``max_tokens``, ``stream``, ``kv_transfer_params``, ...);
* fields that would change the output but are not implemented (``n`` > 1,
  ``logprobs``, ``stop``, ``tools``, sampling knobs...) are accepted only at
  their neutral value (``null``, or the one that asks for nothing), else a
  400 naming every one of them;
* fields that change nothing here (``seed``: decoding is greedy; ``user``;
  ``ignore_eos``: the model has no EOS) are type-checked and ignored;
* unknown top-level fields are ignored, as vLLM ignores them, and returned in
  :attr:`GenerationRequest.ignored` so the server can log them.

The chat template (:func:`chat_prompt`) is the tiny model's: it has no
tokenizer of its own, its tokens are the UTF-8 bytes of the text.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs

from trio_pd._core._public_values import RemoteBlocks
from trio_pd._serve.errors import HTTPError
from trio_pd._serve.fields import (
    ANY,
    CHAT,
    CHAT_NEUTRAL,
    COMPLETIONS,
    COMPLETIONS_NEUTRAL,
    KV_TYPES,
    MAX_BLOCK_ID,
    MESSAGE_NEUTRAL,
    among,
    bounded_int,
    invalid,
    lone_surrogate,
    show,
    typed,
)
from trio_pd._serve.model import tokenize

MODEL_NAME = "trio-pd-tiny"
MAX_TOKENS = 1024
"""The most tokens one request may generate."""
DEFAULT_MAX_TOKENS = 16
"""``max_tokens`` when a request does not say (OpenAI's completions default)."""
MAX_MODEL_LEN = 2048
"""Prompt plus generated tokens (bytes): attention is quadratic in it."""
CHAT_ROLES = ("system", "user", "assistant")
MAX_REQUEST_ID = 128
"""The longest ``X-Request-Id`` taken from a request (a longer one is replaced)."""
LEASE_PARAM = "remote_lease_initial"
"""The ``kv_transfer_params`` key of a prefill answer that says how long (in
seconds, from the answer) the exposure waits for a decode engine's hold: the
prefill engine's ``lease_initial``. The proxy starts no decode request after
that (see :mod:`.defaults`); a decode engine ignores it."""

Kind = Literal["prefill", "decode", "whole"]


@attrs.frozen
class GenerationRequest:
    """A checked completions or chat request.

    Attributes:
        prompt: its tokens (for chat, of the templated conversation).
        max_tokens: how many tokens to generate (exactly: greedy decoding of
            a model without EOS always runs to ``max_tokens``).
        stream: answer with server-sent events.
        include_usage: (streaming) end with a chunk carrying ``usage``.
        kv_transfer_params: vLLM's P/D parameters as given (``{}`` if none).
        kind: ``"prefill"`` (``do_remote_decode``), ``"decode"``
            (``do_remote_prefill``) or ``"whole"``.
        ignored: unknown top-level fields, ignored (for a warning in the log).
    """

    prompt: list[int]
    max_tokens: int
    stream: bool = False
    include_usage: bool = False
    kv_transfer_params: dict[str, Any] = attrs.field(factory=dict)
    kind: Kind = "whole"
    ignored: tuple[str, ...] = ()


def chat_prompt(messages: Iterable[tuple[str, str]], add_generation_prompt: bool = True) -> str:
    """The tiny model's chat template: ``"<|role|>\\ncontent\\n"`` per message,
    then ``"<|assistant|>\\n"`` (unless ``add_generation_prompt`` is false).

    >>> chat_prompt([("system", "Be brief."), ("user", "Hi")])
    '<|system|>\\nBe brief.\\n<|user|>\\nHi\\n<|assistant|>\\n'
    """
    text = "".join(f"<|{role}|>\n{content}\n" for role, content in messages)
    return text + "<|assistant|>\n" if add_generation_prompt else text


def parse_completions_request(body: object) -> GenerationRequest:
    """``POST /v1/completions``: a checked request, or an :class:`HTTPError` (4xx)."""
    fields = _checked_body(body, COMPLETIONS_NEUTRAL)
    prompt = _prompt(fields.get("prompt"))
    return _generation(fields, prompt, "max_tokens", COMPLETIONS, COMPLETIONS_NEUTRAL)


def parse_chat_request(body: object) -> GenerationRequest:
    """``POST /v1/chat/completions``: a checked request whose prompt is the
    templated conversation (:func:`chat_prompt`), or an :class:`HTTPError` (4xx).

    ``max_completion_tokens`` wins over ``max_tokens`` when both are given
    (as in vLLM; its P/D proxy sets both to 1 for the prefill).
    """
    fields = _checked_body(body, CHAT_NEUTRAL)
    messages = _messages(fields.get("messages"))
    add = typed(fields, "add_generation_prompt", bool, True)
    prompt = tokenize(chat_prompt(messages, add))
    bounded_int(fields, "max_tokens", 1, MAX_TOKENS, DEFAULT_MAX_TOKENS)
    if fields.get("max_completion_tokens") is None:
        return _generation(fields, prompt, "max_tokens", CHAT, CHAT_NEUTRAL)
    return _generation(fields, prompt, "max_completion_tokens", CHAT, CHAT_NEUTRAL)


def request_id_from_headers(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The request's ``X-Request-Id`` if it is usable (1 to :data:`MAX_REQUEST_ID`
    visible ASCII characters, no spaces), else a fresh one (32 hex digits)."""
    for name, value in headers:
        if name.lower() == b"x-request-id":
            if 0 < len(value) <= MAX_REQUEST_ID and all(0x21 <= b <= 0x7E for b in value):
                return value.decode("ascii")
            break
    return uuid.uuid4().hex


def parse_remote_blocks(params: dict[str, Any]) -> RemoteBlocks:
    """The decode request's ``kv_transfer_params`` as :class:`RemoteBlocks`, or a 400."""
    try:
        return RemoteBlocks.from_kv_transfer_params(params)
    except ValueError as exc:
        raise HTTPError(
            400, str(exc), "invalid_request_error", param="kv_transfer_params"
        ) from None


FIRST_TOKEN_PARAM = "first_token"
"""The ``kv_transfer_params`` key of a prefill answer that carries the first
generated token: the prefill engine runs the prompt's last token too (its
KV is in the exposed blocks), so the decode engine starts from that token
at the next position instead of computing it again. Its own answer still
begins with it (the client sees every token once). Parameters without it
(vLLM's shape) mean the blocks hold all but the prompt's last token, which
the decode engine then runs itself."""


def first_token_of(params: Mapping[str, Any], vocab: int) -> int | None:
    """The first token that ``params`` carry (:data:`FIRST_TOKEN_PARAM`), or
    ``None`` if they carry none.

    Raises:
        HTTPError: it is not a token of the model's vocabulary (400).
    """
    token = params.get(FIRST_TOKEN_PARAM)
    if token is None:
        return None
    if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
        raise HTTPError(
            400,
            f"{FIRST_TOKEN_PARAM} must be a token id in [0, {vocab}), got {show(token)}",
            "invalid_request_error",
            param=f"kv_transfer_params.{FIRST_TOKEN_PARAM}",
        )
    return token


def check_prompt_blocks(remote: RemoteBlocks, blocks: int, prompt_tokens: int) -> None:
    """A 400 unless ``remote`` holds the ``blocks`` that the prompt's KV fills."""
    if len(remote.block_ids) != blocks:
        raise HTTPError(
            400,
            f"kv_transfer_params hold {len(remote.block_ids)} blocks, a prompt of "
            f"{prompt_tokens} tokens needs {blocks}",
            "invalid_request_error",
            param="kv_transfer_params.remote_block_ids",
        )


def _checked_body(body: object, neutral: Mapping[str, tuple[Any, ...]]) -> dict[str, Any]:
    """``body`` if it is an object of valid Unicode whose unimplemented fields are neutral."""
    if not isinstance(body, dict):
        raise HTTPError(400, "the body must be a JSON object", "invalid_request_error")
    where = lone_surrogate(body)
    if where is not None:
        where = where[:100]
        raise HTTPError(
            400,
            f"{where or 'the body'} is not valid Unicode (a lone surrogate)",
            "invalid_request_error",
            param=where or None,
        )
    unsupported = [
        name for name, values in neutral.items() if name in body and not among(body[name], values)
    ]
    if unsupported:
        shown = ", ".join(f"{name}={show(body[name])}" for name in unsupported)
        raise HTTPError(
            400,
            f"not supported by this engine: {shown} (each field is accepted only at a value "
            "that asks for nothing: null, or its default)",
            "invalid_request_error",
            param=unsupported[0],
            code="unsupported_value",
        )
    model = body.get("model")
    if model is not None and model != MODEL_NAME:
        if not isinstance(model, str):
            raise invalid("model", "a string")
        raise HTTPError(
            404,
            f"The model `{model[:200]}` does not exist (this engine serves `{MODEL_NAME}`)",
            "invalid_request_error",
            param="model",
            code="model_not_found",
        )
    return body


def _generation(
    fields: dict[str, Any],
    prompt: list[int],
    max_tokens_field: str,
    known: Mapping[str, object],
    neutral: Mapping[str, object],
) -> GenerationRequest:
    """The fields common to completions and chat, checked."""
    for name, kind in known.items():
        if kind is not ANY:
            typed(fields, name, kind, None)  # (type errors first, in a stable order)
    max_tokens = bounded_int(fields, max_tokens_field, 1, MAX_TOKENS, DEFAULT_MAX_TOKENS)
    temperature = fields.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or temperature != 0
    ):
        raise HTTPError(
            400,
            f"temperature={show(temperature)}: only temperature 0 (greedy) is supported",
            "invalid_request_error",
            param="temperature",
            code="unsupported_value",
        )
    stream = typed(fields, "stream", bool, False)
    include_usage = _stream_options(fields.get("stream_options"))
    params, kind = _kv_transfer_params(fields.get("kv_transfer_params"))
    if kind != "prefill":  # (a prefill generates nothing: P/D proxies pass min_tokens along)
        for name in ("min_tokens", "min_completion_tokens"):
            bounded_int(fields, name, 0, max_tokens, 0)
    ignored = tuple(name for name in fields if name not in known and name not in neutral)
    return GenerationRequest(prompt, max_tokens, stream, include_usage, params, kind, ignored)


def _prompt(value: object) -> list[int]:
    """A completions prompt: a string, a list of token ids (0-255), or a list of one of these."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # (a batch of one)
    if isinstance(value, str) and value:
        return tokenize(value)
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 256 for t in value)
    ):
        return list(value)
    if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        raise HTTPError(
            400,
            "prompt: one prompt per request (no batches)",
            "invalid_request_error",
            param="prompt",
            code="unsupported_value",
        )
    raise invalid("prompt", "a non-empty string, or a non-empty list of token ids (0-255)")


def _messages(value: object) -> list[tuple[str, str]]:
    """``(role, content)`` of each chat message (text parts joined with newlines)."""
    if not isinstance(value, list) or not value:
        raise invalid("messages", "a non-empty list of messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(where, "an object with role and content")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"{where}.role", " or ".join(map(repr, CHAT_ROLES)))
        for key in message:
            if key in MESSAGE_NEUTRAL and not among(message[key], MESSAGE_NEUTRAL[key]):
                raise HTTPError(
                    400,
                    f"{where}.{key} is not supported by this engine",
                    "invalid_request_error",
                    param=f"{where}.{key}",
                    code="unsupported_value",
                )
            if key not in MESSAGE_NEUTRAL and key not in ("role", "content", "name"):
                raise invalid(f"{where}.{key}", "absent (an unknown message field)")
        typed(message, "name", str, None, where)  # (accepted, not rendered)
        out.append((role, _content(message.get("content"), f"{where}.content")))
    return out


def _content(value: object, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise invalid(f"{where}[{i}]", 'a text part, {"type": "text", "text": ...}')
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise invalid(f"{where}[{i}]", 'exactly {"type": "text", "text": <string>}')
            texts.append(part["text"])
        return "\n".join(texts)
    raise invalid(where, "a string or a list of text parts")


def _stream_options(value: object) -> bool:
    """``include_usage`` (accepted, and ignored, without ``stream``: P/D proxies
    turn streaming off for the prefill and may leave the options in)."""
    if value is None:
        return False
    assert isinstance(value, dict)  # (typed)
    for key in value:
        if key not in ("include_usage", "continuous_usage_stats", "include_obfuscation"):
            raise invalid(f"stream_options.{key}", "absent (an unknown option)")
    if not among(value.get("continuous_usage_stats"), (None, False)):
        raise HTTPError(
            400,
            "stream_options.continuous_usage_stats is not supported",
            "invalid_request_error",
            param="stream_options.continuous_usage_stats",
            code="unsupported_value",
        )
    typed(value, "include_obfuscation", bool, None, "stream_options")  # (no obfuscation)
    return bool(typed(value, "include_usage", bool, False, "stream_options"))


def _kv_transfer_params(value: object) -> tuple[dict[str, Any], Kind]:
    """vLLM's ``kv_transfer_params`` (any of its keys may be null; unknown keys
    pass), type-checked, and the request's kind."""
    if value is None:
        return {}, "whole"
    assert isinstance(value, dict)  # (typed)
    for key, kind in KV_TYPES.items():
        typed(value, key, kind, None, "kv_transfer_params")
    blocks = value.get("remote_block_ids")
    if blocks is not None and not all(
        isinstance(b, int) and not isinstance(b, bool) and 0 <= b < MAX_BLOCK_ID for b in blocks
    ):
        raise invalid("kv_transfer_params.remote_block_ids", "a list of block ids (ints >= 0)")
    decode, prefill = value.get("do_remote_decode"), value.get("do_remote_prefill")
    if decode and prefill:
        raise HTTPError(
            400,
            "kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive",
            "invalid_request_error",
            param="kv_transfer_params.do_remote_prefill",
        )
    return value, "prefill" if decode else "decode" if prefill else "whole"
