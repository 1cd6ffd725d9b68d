"""The fields of OpenAI's completions and chat requests, as this engine takes them,
and the checks that turn a bad value into a 400 naming it (no I/O).

See :mod:`trio_pd._serve.openai` for the policy.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from trio_pd._serve.errors import HTTPError

ANY = object()  # (a field ignored at any value of its type)
BOTH_NEUTRAL: dict[str, tuple[Any, ...]] = {
    # Not implemented: accepted only at these values (``None`` is JSON null).
    "n": (None, 1),
    "stop": (None, []),
    "stop_token_ids": (None, []),
    "top_p": (None, 1),
    "top_k": (None, -1, 0),
    "min_p": (None, 0),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "length_penalty": (None, 1),
    "logit_bias": (None, {}),
    "use_beam_search": (None, False),
    "prompt_logprobs": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
    "response_format": (None, {"type": "text"}),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "logits_processors": (None,),
    "return_tokens_as_token_ids": (None, False),
    "priority": (None, 0),
    "vllm_xargs": (None, {}),
}
COMPLETIONS_NEUTRAL = {
    **BOTH_NEUTRAL,
    "logprobs": (None,),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "prompt_embeds": (None,),
}
CHAT_NEUTRAL = {
    **BOTH_NEUTRAL,
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
}
BOTH = {
    # Used here, or harmless at any value of their type.
    "model": str,
    "max_tokens": int,
    "temperature": ANY,  # (checked: 0 only)
    "stream": bool,
    "stream_options": dict,
    "kv_transfer_params": dict,
    "min_tokens": int,
    "min_completion_tokens": int,  # (vLLM's P/D proxy sends it, null)
    "seed": int,  # (decoding is greedy)
    "user": str,
    "ignore_eos": bool,  # (the model has no EOS)
    "skip_special_tokens": bool,  # (nor special tokens)
    "spaces_between_special_tokens": bool,
    "include_stop_str_in_output": bool,  # (nor stop strings)
    "add_special_tokens": bool,
    "return_token_ids": bool,  # (always returned)
    "cache_salt": str,  # (no prefix cache)
    "request_id": str,  # (X-Request-Id names the request)
}
COMPLETIONS = {**BOTH, "prompt": ANY}
CHAT = {
    **BOTH,
    "messages": ANY,
    "max_completion_tokens": int,
    "add_generation_prompt": bool,
    "parallel_tool_calls": bool,  # (no tools)
    "metadata": dict,
    "store": bool,
    "service_tier": str,
}
MESSAGE_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tool_calls": (None, []),
    "tool_call_id": (None,),
    "function_call": (None,),
    "audio": (None,),
    "refusal": (None,),
    "annotations": (None, []),
    "reasoning_content": (None,),
}
KV_TYPES: dict[str, type] = {
    "do_remote_decode": bool,
    "do_remote_prefill": bool,
    "remote_engine_id": str,
    "remote_host": str,
    "remote_port": int,
    "remote_block_ids": list,
    "remote_request_id": str,
    "remote_incarnation": str,
    "remote_token": str,
    "tp_size": int,
}
MAX_BLOCK_ID = 2**32


def typed(fields: Mapping[str, Any], name: str, kind: Any, default: Any, within: str = "") -> Any:
    """``fields[name]`` if absent/null (``default``) or of type ``kind``, else a 400."""
    value = fields.get(name)
    if value is None:
        return default
    if isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool):
        return value
    expected = {bool: "true or false", int: "an integer", str: "a string", dict: "an object"}
    raise invalid(f"{within}.{name}" if within else name, expected.get(kind, "a list"))


def bounded_int(fields: Mapping[str, Any], name: str, low: int, high: int, default: int) -> int:
    """``fields[name]``, an int in ``[low, high]`` (``default`` if absent/null), else a 400."""
    value = typed(fields, name, int, default)
    if not low <= value <= high:
        raise invalid(name, f"an integer in [{low}, {high}]", value)
    return int(value)


def among(value: object, allowed: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of ``allowed``, types kept apart (``true`` is not 1)."""
    return any(_kind_of(value) == _kind_of(a) and value == a for a in allowed)


def _kind_of(value: object) -> str:
    if isinstance(value, bool) or value is None:
        return repr(value)
    return "number" if isinstance(value, int | float) else type(value).__name__


def show(value: object, limit: int = 60) -> str:
    """A request's value as JSON, cut short (for messages)."""
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):  # (an int of more digits than Python prints)
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


_UNSET = object()


def invalid(param: str, expected: str, value: object = _UNSET) -> HTTPError:
    """A 400 saying what ``param`` must be (and what it was, if ``value`` is given)."""
    got = "" if value is _UNSET else f", got {show(value)}"
    return HTTPError(400, f"{param} must be {expected}{got}", "invalid_request_error", param=param)


def lone_surrogate(value: object) -> str | None:
    """The path of the first string (or key) in ``value`` that is not valid
    Unicode (``""`` for the value itself), else ``None``. Iterative: the JSON
    may be as deep as the parser allowed."""
    stack: list[tuple[str, object]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not _encodes(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                if not _encodes(str(key)):
                    return path or "a field name"
                if isinstance(child, str | dict | list):
                    stack.append((f"{path}.{key}" if path else str(key), child))
        elif isinstance(item, list):
            stack.extend(
                (f"{path}[{i}]", child)
                for i, child in enumerate(item)
                if isinstance(child, str | dict | list)
            )
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
