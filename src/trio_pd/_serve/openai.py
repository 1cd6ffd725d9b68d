"""The OpenAI-compatible request and response shapes, and vLLM's P/D parameters (no I/O).

Parsing turns a request body into checked values or an :class:`~.asgi.HTTPError`
(4xx, naming the field); building turns results into response bodies.
"""

from __future__ import annotations

import time
from typing import Any

from .._records import RemoteBlocks
from .asgi import HTTPError
from .model import tokenize

MODEL_NAME = "trio-pd-tiny"
MAX_TOKENS = 1024
MAX_MODEL_LEN = 2048
"""Prompt plus generated tokens (bytes): attention is quadratic in it."""


def completion(
    request_id: str, text: str, token_ids: list[int], prompt_tokens: int, **extra: Any
) -> dict[str, Any]:
    """An OpenAI completions response body (``token_ids``: vLLM's addition)."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": MODEL_NAME,
        "choices": [
            {
                "index": 0,
                "text": text,
                "token_ids": token_ids,
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(token_ids),
            "total_tokens": prompt_tokens + len(token_ids),
        },
        **extra,
    }


def parse_remote_blocks(params: dict[str, Any]) -> RemoteBlocks:
    """The decode request's ``kv_transfer_params`` as :class:`RemoteBlocks`, or a 400."""
    try:
        return RemoteBlocks.from_kv_transfer_params(params)
    except ValueError as exc:
        raise HTTPError(
            400, str(exc), "invalid_request_error", param="kv_transfer_params"
        ) from None


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


def parse_completion_request(body: dict[str, Any]) -> tuple[list[int], int, bool, dict[str, Any]]:
    """``(prompt tokens, max_tokens, stream, kv_transfer_params)``, or a 400."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise HTTPError(400, "prompt must be a non-empty string", "invalid_request_error")
    try:
        prompt.encode()
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800" in the JSON)
        raise HTTPError(
            400, f"prompt is not valid Unicode: {exc.reason}", "invalid_request_error"
        ) from None
    max_tokens = body.get("max_tokens", 16)
    if (
        not isinstance(max_tokens, int)
        or isinstance(max_tokens, bool)
        or not (1 <= max_tokens <= MAX_TOKENS)
    ):
        raise HTTPError(
            400, f"max_tokens must be an int in [1, {MAX_TOKENS}]", "invalid_request_error"
        )
    if body.get("temperature", 0) not in (0, 0.0):
        raise HTTPError(400, "only temperature 0 (greedy) is supported", "invalid_request_error")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HTTPError(400, "stream must be true or false", "invalid_request_error")
    params = body.get("kv_transfer_params") or {}
    if not isinstance(params, dict):
        raise HTTPError(400, "kv_transfer_params must be an object", "invalid_request_error")
    return tokenize(prompt), max_tokens, stream, params
