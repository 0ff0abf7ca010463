"""transformers models built from a config with random init: no hub download, no tokenizer.

transformers is optional (``pip install "zero-strategy[models]"``); it is imported only when one
of these builders runs, so the rest of the package works without it.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn


def _transformers() -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError as err:
        raise ImportError(
            f"this model needs the optional dependency transformers ({err}); install it with "
            "`pip install \"zero-strategy[models]\"`, or pick model=gpt (the package's own GPT)."
        ) from err


def bert_for_classification(num_labels: int, vocab_size: int = 256, max_position_embeddings: int = 128,
                            hidden_size: int = 128, num_hidden_layers: int = 2, num_attention_heads: int = 2,
                            intermediate_size: int = 512, dropout: float = 0.1, **config: Any) -> nn.Module:
    """``BertForSequenceClassification(BertConfig(...))``, randomly initialised.

    The defaults are a tiny BERT (about 0.5M parameters) over byte ids that trains on CPU in
    a minute; BERT-base is ``hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
    intermediate_size=3072, vocab_size=30522, max_position_embeddings=512``. Extra keyword
    arguments go to BertConfig unchanged. ``dropout`` 0.1 is BERT's own, for both hidden states
    and attention probabilities.
    """
    tf = _transformers()
    cfg = tf.BertConfig(vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
                        hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                        num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                        num_labels=num_labels, pad_token_id=0, **config)
    return tf.BertForSequenceClassification(cfg)


def gpt2_lm_head(vocab_size: int = 256, n_positions: int = 128, n_embd: int = 128, n_layer: int = 4,
                 n_head: int = 4, dropout: float = 0.0, **config: Any) -> nn.Module:
    """``GPT2LMHeadModel(GPT2Config(...))``, randomly initialised, input and output embeddings tied.

    The defaults match the package's own GPT (conf/model/gpt.yaml) so the two can be compared;
    GPT-2 small is ``n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257``.
    Extra keyword arguments go to GPT2Config unchanged.
    """
    tf = _transformers()
    # byte-level ids have no special tokens; GPT-2's defaults (50256) would lie outside the vocabulary
    special = {"bos_token_id": vocab_size - 1, "eos_token_id": vocab_size - 1}
    cfg = tf.GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                        n_head=n_head, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        tie_word_embeddings=True, **{**special, **config})
    return tf.GPT2LMHeadModel(cfg)
