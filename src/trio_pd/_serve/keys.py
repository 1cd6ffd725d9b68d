"""Who may call: bearer keys on ``/v1/*`` (no I/O).

Two kinds of key guard the HTTP servers of a deployment:

* **client keys** on the proxy, or on a decode-first engine (``--api-key``,
  ``TRIO_PD_API_KEY``, which may hold several separated by spaces): what an
  OpenAI client sends as ``Authorization: Bearer <key>``;
* **the internal key** on the engines (``--internal-key-file``,
  ``TRIO_PD_INTERNAL_KEY``): the deployment's own, which the proxy sends
  and clients never see, so that no client reaches an engine around the
  proxy (a decode engine takes ``kv_transfer_params`` from whoever calls it).

Only ``/v1/*`` is guarded; ``/health`` and ``/metrics`` stay open (they say
nothing a request could use, and probes rarely carry keys). Keys are compared
in constant time, every configured key every time, and never logged: an
error says which header was missing or wrong, not what it held.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Sequence

from trio_pd._serve.errors import HTTPError

GUARDED_PREFIX = "/v1/"
API_KEY_ENV = "TRIO_PD_API_KEY"
INTERNAL_KEY_ENV = "TRIO_PD_INTERNAL_KEY"
MIN_KEY_LENGTH = 16  # (characters: a key shorter than this is a typo, not a secret)


class BearerKeys:
    """The keys that a server accepts as ``Authorization: Bearer <key>``.

    Args:
        keys: the accepted keys (at least one; each at least 16 characters,
            printable ASCII without spaces).
        audience: who the keys are for, in the 401's message: ``"client"``
            (the proxy) or ``"internal"`` (an engine).

    Raises:
        ValueError: no key, or a key that is too short or not printable
            (the message does not contain the key).
    """

    def __init__(self, keys: Iterable[str], *, audience: str) -> None:
        self._keys = tuple(k.encode() for k in keys)
        if not self._keys:
            raise ValueError("at least one key is needed")
        for i, key in enumerate(self._keys, 1):
            if len(key) < MIN_KEY_LENGTH or not all(0x21 <= b <= 0x7E for b in key):
                raise ValueError(
                    f"key {i} must be at least {MIN_KEY_LENGTH} printable ASCII characters "
                    "without spaces"
                )
        self.audience = audience

    def __repr__(self) -> str:  # (never the keys)
        return f"BearerKeys({len(self._keys)} keys, audience={self.audience!r})"

    def joined(self) -> str:
        """The keys, separated by spaces: the value of ``TRIO_PD_API_KEY`` that
        hands them to another process (in its environment; never on a command
        line, and never printed)."""
        return " ".join(k.decode() for k in self._keys)

    def accepts(self, key: str) -> bool:
        """Whether ``key`` is one of the keys (in constant time)."""
        matched = False
        for mine in self._keys:
            matched |= hmac.compare_digest(mine, key.encode())
        return matched

    def guards(self, path: str) -> bool:
        """Whether a request to ``path`` needs a key."""
        return path.startswith(GUARDED_PREFIX)

    def check(self, headers: Sequence[tuple[bytes, bytes]]) -> None:
        """Accept the request whose ``authorization`` header carries one of the keys.

        Raises:
            HTTPError: 401, OpenAI's ``invalid_api_key`` (with ``WWW-Authenticate:
                Bearer``), naming what was missing or wrong but not the key.
        """
        values = [v for k, v in headers if k.lower() == b"authorization"]
        if len(values) != 1:
            raise self._refused(
                "no Authorization header" if not values else "several Authorization headers"
            )
        scheme, _, presented = values[0].strip().partition(b" ")
        if scheme.lower() != b"bearer" or not presented.strip():
            raise self._refused("the Authorization header is not 'Bearer <key>'")
        # (all of them: the time says nothing about which)
        if not self.accepts(presented.strip().decode(errors="replace")):
            raise self._refused("the key is not valid here")

    def _refused(self, why: str) -> HTTPError:
        if self.audience == "internal":
            message = (
                f"{why}: this engine serves its deployment's proxy only "
                "(send requests to the proxy)"
            )
        else:
            message = f"{why}: send 'Authorization: Bearer <your API key>'"
        error = HTTPError(401, message, "invalid_request_error", code="invalid_api_key")
        error.headers.append((b"www-authenticate", b"Bearer"))
        return error


def bearer_header(key: str) -> dict[str, str]:
    """The header that presents ``key``."""
    return {"Authorization": f"Bearer {key}"}
