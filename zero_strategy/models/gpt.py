"""A small GPT-style causal language model: token + position embeddings, pre-norm transformer
blocks with causal self-attention, and an output head that shares the token embedding's weight.

Built from plain arguments (Hydra passes them from conf/model/gpt.yaml) with random init, so it
needs no download and its size is one override away: ``model.net.n_layer=12 model.net.n_embd=768``.

Shapes in the comments: B batch, T time (sequence length), C channels (n_embd), H heads,
V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """Multi-head attention where position t only sees positions <= t."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}; "
                             f"try n_head={math.gcd(n_embd, n_head)} or n_embd={n_head * (n_embd // n_head + 1)}")
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # one matmul for queries, keys and values
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        # (B, T, C) -> (B, H, T, C/H): each head attends independently
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)  # (B, H, T, C/H)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.resid_dropout(self.proj(y))  # (B, T, C)


class FeedForward(nn.Module):
    """Position-wise MLP, 4x wider inside as in GPT-2."""

    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.up = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.down = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))  # (B, T, 4C) inside, (B, T, C) out


class Block(nn.Module):
    """Pre-norm residual block: normalising before each sub-layer keeps deep stacks trainable
    without warm-up tricks, which is why GPT-2 moved the LayerNorms there."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_ff = nn.LayerNorm(n_embd, bias=bias)
        self.ff = FeedForward(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))  # (B, T, C)
        return x + self.ff(self.ln_ff(x))  # (B, T, C)


class GPT(nn.Module):
    """Decoder-only transformer returning next-token logits of shape (B, T, V).

    The defaults are a tiny model (about 0.8M parameters) that learns byte-level Python source in
    a couple of minutes on two CPU cores; GPT-2 small is ``n_layer=12, n_head=12, n_embd=768,
    block_size=1024, vocab_size=50257``.
    """

    def __init__(self, vocab_size: int = 256, block_size: int = 128, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        # vocab_size 256: one token per byte, so no tokenizer has to be downloaded.
        # block_size 128: the longest context; position embeddings exist only up to it.
        # dropout 0.0: short runs on plenty of data do not overfit; raise it for fine-tuning.
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)  # token embedding, (V, C)
        self.wpe = nn.Embedding(block_size, n_embd)  # position embedding, (T_max, C)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        # Tied embeddings: reading and writing tokens share one (V, C) matrix, which saves V*C
        # parameters and helps small models. ZeRO must see it as one parameter, not two.
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # Residual projections add into the stream once per layer, twice per block; scaling
        # their init by 1/sqrt(2 * n_layer) keeps the stream's variance flat with depth (GPT-2).
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "ff.down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)  # GPT-2's std: small logits at start
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape  # (B, T) token ids
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.block_size}; shorten the "
                             f"sequences (data.seq_len) or build the model with block_size >= {T}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C) + (T, C) -> (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        return self.lm_head(self.ln_f(x))  # (B, T, V)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` continuations of ``idx`` (B, T); returns (B, T + new)."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.block_size:])[:, -1, :] / temperature  # (B, V): last position only
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)  # (B, 1)
            idx = torch.cat([idx, nxt], dim=1)  # (B, T + 1)
        return idx
