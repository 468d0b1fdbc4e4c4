"""Hugging Face models built from their configs (no download), for the equality tests.

A two-layer GPT-2 (tied input and output embeddings) and a two-layer BERT for masked
language modelling (no pooler). ``dropout=False`` zeroes every dropout probability, for
loops that run two systems one after the other in one process (the draws would differ).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models from their configs: nothing to download

import torch  # noqa: E402
import transformers  # noqa: E402


def gpt2(vocab: int, dropout: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    off = {} if dropout else dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab, n_positions=64,
                                     bos_token_id=0, eos_token_id=0, **off)
    return transformers.GPT2LMHeadModel(config)


def bert(vocab: int, dropout: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    off = {} if dropout else dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                     intermediate_size=128, vocab_size=vocab, max_position_embeddings=64,
                                     pad_token_id=0, **off)
    return transformers.BertForMaskedLM(config)
