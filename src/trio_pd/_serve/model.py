"""A tiny Llama-style causal transformer with a paged KV cache (no I/O, no trio).

Real enough to prove disaggregation end to end -- RMSNorm, rotary positions,
grouped-query attention, a gated SiLU MLP, greedy decoding -- and small enough
to run anywhere: seeded random weights (nothing is downloaded), byte-level
tokens (0-255; it writes printable ASCII only), float32 on the CPU (or CUDA when the caller asks).

The KV cache is what trio_pd moves: one tensor per layer for K and one for V
(regions ``k0, v0, k1, v1, ...``), each ``(num_blocks, kv_heads, block_size,
head_dim)`` -- dimension 0 blocks, dimension 1 KV heads, the layout
``open_connector`` and tensor parallelism expect. A request's positions map
to blocks through its *block table*: position ``p`` lives in block
``table[p // block_size]`` at offset ``p % block_size``.

Disaggregated and single-engine serving must produce the same tokens, so both
use the same steps: :meth:`TinyLlama.forward` over the prompt without its
last token, then one forward per token from the prompt's last token on. A
prefill engine does the first and the second (the prompt's last token,
which gives the first generated token) and exposes the blocks; a decode
engine pulls them and goes on from that token. The same floats in the same
order give the same greedy tokens, bit for bit.

torch is imported where a model computes, not with this module: the proxy and
``trio-pd serve`` read :class:`ModelConfig` only, and start without torch's
import (about 1.5 s of CPU here).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    import torch


@attrs.frozen
class ModelConfig:
    """The model's shape; every engine of a deployment must use the same one."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    mlp: int = 128
    vocab: int = 256  # bytes
    block_size: int = 16  # tokens per KV block
    rope_theta: float = 10000.0
    seed: int = 0

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` positions."""
        return -(-tokens // self.block_size)


class TinyLlama:
    """The model: weights, and a forward step that reads and writes a paged cache.

    Thread-safe for concurrent forwards on *different* block tables (the
    weights are only read); engines run forwards in a worker thread.
    """

    def __init__(self, config: ModelConfig, device: str = "cpu") -> None:
        self.config = c = config
        self.device = device
        import torch

        generator = torch.Generator().manual_seed(c.seed)

        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=generator) / rows**0.5
            return w.to(device)

        self.embed = weight(c.vocab, c.hidden) * c.vocab**0.5
        self.layers = [
            {
                "wq": weight(c.hidden, c.heads * c.head_dim),
                "wk": weight(c.hidden, c.kv_heads * c.head_dim),
                "wv": weight(c.hidden, c.kv_heads * c.head_dim),
                "wo": weight(c.heads * c.head_dim, c.hidden),
                "w1": weight(c.hidden, c.mlp),
                "w3": weight(c.hidden, c.mlp),
                "w2": weight(c.mlp, c.hidden),
            }
            for _ in range(c.layers)
        ]
        self.lm_head = weight(c.hidden, c.vocab)
        # Output only printable ASCII (random weights make random bytes; this
        # keeps the text readable): other tokens get -inf.
        self._printable = torch.full((c.vocab,), float("-inf"), device=device)
        self._printable[32:127] = 0.0
        half = c.head_dim // 2
        self._inv_freq = 1.0 / (
            c.rope_theta ** (torch.arange(half, dtype=torch.float32, device=device) / half)
        )

    def new_cache(self, num_blocks: int, tp_size: int = 1) -> list[list[torch.Tensor]]:
        """A zeroed KV cache of ``num_blocks`` blocks, per tensor-parallel rank.

        Rank ``r`` holds KV heads ``r*h .. r*h + h - 1`` (``h = kv_heads //
        tp_size``) of every block: ``[k0, v0, k1, v1, ...]``, each
        ``(num_blocks, h, block_size, head_dim)`` -- what a rank's connector
        registers.

        Raises:
            ValueError: ``tp_size`` does not divide the KV heads.
        """
        import torch

        c = self.config
        if tp_size < 1 or c.kv_heads % tp_size:
            raise ValueError(f"tensor-parallel size {tp_size} must divide {c.kv_heads} KV heads")
        shape = (num_blocks, c.kv_heads // tp_size, c.block_size, c.head_dim)
        return [
            [
                torch.zeros(shape, dtype=torch.float32, device=self.device)
                for _ in range(2 * c.layers)
            ]
            for _ in range(tp_size)
        ]

    def forward(
        self,
        cache: Sequence[Sequence[torch.Tensor]],
        block_table: Sequence[int],
        tokens: Sequence[int],
        start: int,
    ) -> int:
        """Run ``tokens`` at positions ``start, start+1, ...``; return the next token.

        ``cache`` is :meth:`new_cache`'s, one list of regions per rank (the
        ranks' head slices are written and read back together: one process
        computes for every rank). Writes their K and V into it through
        ``block_table`` and attends to every position before them (read from
        the cache), so the positions ``0 .. start-1`` must already be there --
        computed here, or pulled from a prefill engine. Returns the greedy
        next token. (No tensor here requires gradients, so autograd records
        nothing.)
        """
        import torch

        c = self.config
        count = len(tokens)
        end = start + count
        table = torch.as_tensor(list(block_table), dtype=torch.long, device=self.device)
        positions = torch.arange(start, end, device=self.device)
        every = torch.arange(end, device=self.device)
        new_blocks, new_offsets = table[positions // c.block_size], positions % c.block_size
        all_blocks, all_offsets = table[every // c.block_size], every % c.block_size
        causal = every[None, :] <= positions[:, None]  # (count, end)
        x = self.embed[torch.as_tensor(list(tokens), dtype=torch.long, device=self.device)]
        for layer, w in enumerate(self.layers):
            h = _rms_norm(x)
            q = (h @ w["wq"]).view(count, c.heads, c.head_dim)
            k = (h @ w["wk"]).view(count, c.kv_heads, c.head_dim)
            v = (h @ w["wv"]).view(count, c.kv_heads, c.head_dim)
            q, k = self._rope(q, positions), self._rope(k, positions)
            per_rank = c.kv_heads // len(cache)
            for rank, regions in enumerate(cache):
                heads = slice(rank * per_rank, (rank + 1) * per_rank)
                regions[2 * layer][new_blocks, :, new_offsets] = k[:, heads]
                regions[2 * layer + 1][new_blocks, :, new_offsets] = v[:, heads]
            keys = torch.cat(  # (end, kv_heads, head_dim)
                [regions[2 * layer][all_blocks, :, all_offsets] for regions in cache], dim=1
            )
            values = torch.cat(
                [regions[2 * layer + 1][all_blocks, :, all_offsets] for regions in cache], dim=1
            )
            group = c.heads // c.kv_heads
            keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # (heads, end, d)
            values = values.repeat_interleave(group, dim=1).transpose(0, 1)
            scores = q.transpose(0, 1) @ keys.transpose(1, 2) / c.head_dim**0.5
            scores = scores.masked_fill(~causal, float("-inf"))
            attended = torch.softmax(scores, dim=-1) @ values  # (heads, count, d)
            x = x + attended.transpose(0, 1).reshape(count, -1) @ w["wo"]
            h = _rms_norm(x)
            x = x + (torch.nn.functional.silu(h @ w["w1"]) * (h @ w["w3"])) @ w["w2"]
        logits = (_rms_norm(x[-1:]) @ self.lm_head)[0]
        return int(torch.argmax(logits + self._printable))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        import torch

        angles = positions[:, None].float() * self._inv_freq[None, :]  # (count, half)
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        first, second = x[..., ::2], x[..., 1::2]
        return torch.stack(
            (first * cos - second * sin, first * sin + second * cos), dim=-1
        ).flatten(-2)


def _rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def tokenize(text: str) -> list[int]:
    """Byte-level tokens: the UTF-8 bytes of ``text``."""
    return list(text.encode())
