"""Models for the Hydra app and the examples: networks (``GPT``, ``MLP``, builders for
transformers' BERT and GPT-2) and the LightningModules that train them."""

from .classifier import MLP, ClassifierModule
from .gpt import GPT
from .hf import bert_for_classification, gpt2_lm_head
from .language_model import CausalLMModule
from .optim import warmup_cosine

__all__ = ["GPT", "MLP", "CausalLMModule", "ClassifierModule", "bert_for_classification", "gpt2_lm_head",
           "warmup_cosine"]
