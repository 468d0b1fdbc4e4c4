"""Small synthetic-data models for the demo, the examples, the tests and the benchmarks.

Each builder returns ``(model, make_batch)`` where ``make_batch(batch_size, generator)``
returns ``(inputs, targets)`` for ``torch.nn.functional.cross_entropy(model(inputs), targets)``.

>>> model, make_batch = build("tiny")
>>> x, y = make_batch(4, torch.Generator().manual_seed(0))
>>> tuple(model(x).shape)
(4, 10)
"""

from typing import Callable, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

Batch = Callable[[int, torch.Generator], Tuple[torch.Tensor, torch.Tensor]]


def _images(channels: int = 3, size: int = 32, classes: int = 10) -> Batch:
    def make(batch_size: int, generator: torch.Generator):
        x = torch.randn(batch_size, channels, size, size, generator=generator)
        return x, torch.randint(0, classes, (batch_size,), generator=generator)
    return make


def vgg_like(width: int = 64, hidden: int = 2048, fc_layers: int = 6) -> nn.Module:
    """conv [w, w, M, 2w, 2w, M, 4w, 4w, M] + ``fc_layers`` hidden Linear layers + a classifier; 30.5M parameters by default."""
    layers, channels = [], 3
    for out in (width, width, "M", 2 * width, 2 * width, "M", 4 * width, 4 * width, "M"):
        if out == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(channels, out, 3, padding=1), nn.ReLU(inplace=True)]
            channels = out
    layers += [nn.Flatten(), nn.Linear(channels * 4 * 4, hidden), nn.ReLU(inplace=True)]
    for _ in range(fc_layers - 1):
        layers += [nn.Linear(hidden, hidden), nn.ReLU(inplace=True)]
    layers.append(nn.Linear(hidden, 10))
    return nn.Sequential(*layers)


def mlp(width: int = 2048, layers: int = 8) -> nn.Module:
    """3072 -> ``layers`` x Linear(width) -> 10; 35.7M parameters by default."""
    modules, features = [nn.Flatten()], 3 * 32 * 32
    for _ in range(layers):
        modules += [nn.Linear(features, width), nn.ReLU(inplace=True)]
        features = width
    modules.append(nn.Linear(features, 10))
    return nn.Sequential(*modules)


class _Dense(nn.Module):
    def __init__(self, features: int, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.linear(x))


def mlp_blocks(width: int = 256, layers: int = 4) -> nn.Module:
    """:func:`mlp` made of blocks of a class of its own (for compiling each block alone)."""
    blocks = [_Dense(3 * 32 * 32 if index == 0 else width, width) for index in range(layers)]
    return nn.Sequential(nn.Flatten(), *blocks, nn.Linear(width, 10))


class _Residual(nn.Module):
    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        out = channels * stride
        self.conv1 = nn.Conv2d(channels, out, 3, stride=stride, padding=1, bias=False)
        self.conv2 = nn.Conv2d(out, out, 3, padding=1, bias=False)
        self.skip = nn.Conv2d(channels, out, 1, stride=stride, bias=False) if stride > 1 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv2(F.relu(self.conv1(x))) + self.skip(x))


def resnet_like(width: int = 32, blocks: int = 3) -> nn.Module:
    """A small residual CNN (no batch norm, so results do not depend on buffers)."""
    layers = [nn.Conv2d(3, width, 3, padding=1), nn.ReLU(inplace=True)]
    channels = width
    for stage in range(blocks):
        stride = 1 if stage == 0 else 2
        layers.append(_Residual(channels, stride))
        channels *= stride
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)]
    return nn.Sequential(*layers)


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT2Like(nn.Module):
    """A small GPT-2-shaped language model whose output head is the token embedding (tied).

    The tied weight is used twice: by the embedding's own forward and, outside any
    module's forward, by the logits ``h @ wte.weight.T``; the position embedding is read
    directly (``wpe.weight[:T]``) and its module's forward never runs.
    """

    def __init__(self, vocab: int = 512, dim: int = 64, heads: int = 4, layers: int = 2, length: int = 32,
                 embedding_std: float = 1.0) -> None:
        super().__init__()
        self.length = length
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(length, dim)
        if embedding_std != 1.0:  # GPT-2's 0.02 keeps wide tied logits from saturating (denormals: 5x slower)
            for embedding in (self.wte, self.wpe):
                nn.init.normal_(embedding.weight, std=embedding_std)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.wte(tokens) + self.wpe.weight[:length]
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return logits.reshape(-1, logits.shape[-1])


def _tokens(vocab: int, length: int) -> Batch:
    def make(batch_size: int, generator: torch.Generator):
        tokens = torch.randint(0, vocab, (batch_size, length + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:].reshape(-1)
    return make


class HuggingFace(nn.Module):
    """A Hugging Face ``transformers`` model built from its config (no download; needs
    ``pip install transformers``, ``make huggingface``): its logits, one row per token."""

    def __init__(self, kind: str, vocab: int = 8192, width: int = 256, layers: int = 4, heads: int = 8,
                 length: int = 64) -> None:
        super().__init__()
        try:
            import transformers
        except ImportError as error:
            raise ImportError(f"model hf-{kind} needs transformers: pip install transformers "
                              "(make huggingface)") from error
        if kind == "gpt2":  # tied input and output embeddings
            config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab,
                                             n_positions=length, bos_token_id=0, eos_token_id=0)
            self.inner = transformers.GPT2LMHeadModel(config)
        else:  # masked language modelling, no pooler
            config = transformers.BertConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                                             intermediate_size=4 * width, vocab_size=vocab,
                                             max_position_embeddings=length, pad_token_id=0)
            self.inner = transformers.BertForMaskedLM(config)
        self.vocab = vocab

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=tokens).logits.reshape(-1, self.vocab)


def build(name: str) -> Tuple[nn.Module, Batch]:
    """A model by name: vgg, vgg-small, mlp, mlp-small, mlp-blocks, resnet, gpt2, transformer,
    gpt2-small, cnn-small, tiny, hf-gpt2, hf-bert."""
    if name == "vgg":
        return vgg_like(), _images()
    if name == "vgg-small":
        return vgg_like(width=32, hidden=1024, fc_layers=4), _images()
    if name == "mlp":
        return mlp(), _images()
    if name == "mlp-small":
        return mlp(width=512, layers=8), _images()
    if name == "mlp-blocks":
        return mlp_blocks(), _images()
    if name == "resnet":
        return resnet_like(), _images()
    if name == "gpt2":
        return GPT2Like(vocab=8192, dim=256, heads=8, layers=4, length=64), _tokens(8192, 64)
    if name == "transformer":
        # Short sequences, wide layers: ~23M parameters whose sending at 1 Gbit/s takes about
        # as long as their compute on one core (gpt2 is compute-bound there).
        return GPT2Like(vocab=8192, dim=512, heads=8, layers=6, length=16, embedding_std=0.02), _tokens(8192, 16)
    if name == "gpt2-small":
        return GPT2Like(), _tokens(512, 32)
    if name == "cnn-small":
        return vgg_like(width=8, hidden=128, fc_layers=3), _images()
    if name in ("hf-gpt2", "hf-bert"):  # Hugging Face's own, the size of gpt2 above
        return HuggingFace(name[3:]), _tokens(8192, 64)
    if name == "tiny":
        return nn.Sequential(nn.Flatten(), nn.Linear(3072, 64), nn.ReLU(), nn.Linear(64, 10)), _images()
    raise ValueError(f"unknown model {name!r}: use one of {', '.join(MODELS)}")


MODELS = ("vgg", "vgg-small", "mlp", "mlp-small", "mlp-blocks", "resnet",
          "gpt2", "transformer", "gpt2-small", "cnn-small", "tiny", "hf-gpt2", "hf-bert")
