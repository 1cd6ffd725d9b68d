"""OpenAI-compatible response bodies: completions, chat completions, their stream
chunks, the model list (no I/O).

Every choice also carries ``token_ids`` (vLLM's addition): the generated
tokens, which are bytes here. Generation always runs to ``max_tokens`` (the
model has no EOS, and stop strings are not supported), so ``finish_reason``
is ``"length"``.
"""

from __future__ import annotations

import time
from typing import Any

import attrs

from trio_pd._serve.openai import MODEL_NAME


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_list(max_model_len: int, created: int = 0) -> dict[str, Any]:
    """``GET /v1/models``: OpenAI's list of models, with vLLM's ``max_model_len``."""
    return {"object": "list", "data": [model_card(max_model_len, created)]}


def model_card(max_model_len: int, created: int = 0) -> dict[str, Any]:
    """The served model as OpenAI (and vLLM, which adds ``root``, ``parent``,
    ``max_model_len``) describe one."""
    return {
        "id": MODEL_NAME,
        "object": "model",
        "created": created,
        "owned_by": "trio-pd",
        "root": MODEL_NAME,
        "parent": None,
        "max_model_len": max_model_len,
    }


@attrs.frozen
class Shapes:
    """The bodies of one request's response: whole, or chunk by chunk.

    ``chat`` selects ``chat.completion`` (and ``chat.completion.chunk``)
    over ``text_completion``.
    """

    request_id: str
    chat: bool
    prompt_tokens: int
    created: int = attrs.field(factory=lambda: int(time.time()))

    def whole(self, text: str, token_ids: list[int], **extra: Any) -> dict[str, Any]:
        """The non-streamed response (``extra``: more top-level keys)."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(token_ids=token_ids, logprobs=None, finish_reason="length")
        return {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": [choice],
            "usage": usage(self.prompt_tokens, len(token_ids)),
            **extra,
        }

    def first_chunk(self) -> dict[str, Any] | None:
        """(chat) The chunk that opens the stream: the role, no content yet."""
        if not self.chat:
            return None
        return self._chunk({"delta": {"role": "assistant", "content": ""}, "token_ids": []}, None)

    def chunk(
        self, text: str, token_ids: list[int], last: bool, include_usage: bool
    ) -> dict[str, Any]:
        """The chunk of ``token_ids`` (``last``: the stream's last token)."""
        if self.chat:
            choice: dict[str, Any] = {"delta": {"content": text}}
        else:
            choice = {"text": text}
        choice["token_ids"] = token_ids
        chunk = self._chunk(choice, "length" if last else None)
        if include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        """The stream's closing chunk with ``stream_options.include_usage``."""
        return {
            **self._head(self._chunk_object()),
            "choices": [],
            "usage": usage(self.prompt_tokens, completion_tokens),
        }

    def _chunk(self, choice: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, **choice, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(self._chunk_object()), "choices": [choice]}

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": kind, "created": self.created, "model": MODEL_NAME}
