"""Defines nimble's bundled sample models and writes them as TorchScript archives.

    python sample_models/build.py          # rewrites every sample_models/*.pt

Each model is small (under 2 MB of weights) but has the structure that matters for scheduling:
residual joins, wide multi-branch blocks, long depthwise chains, attention (a hand-written
encoder block, a ViT on nn.MultiheadAttention, a BERT-style encoder on int64 token ids and a
mask), several inputs and outputs. Weights come from a fixed seed, and batch norm statistics are randomized so that freezing
has something real to fold.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent


def conv_bn(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = conv_bn(cin, cout, 3, stride)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)) \
            if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.conv1(x)))
        out += self.down(x)
        return F.relu(out)


class ResidualCNN(nn.Module):
    """A small ResNet: stem, three stages of basic blocks, global pooling, classifier."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(conv_bn(3, 16, 3, 2), nn.MaxPool2d(3, 2, 1))
        self.layers = nn.Sequential(BasicBlock(16, 16, 1), BasicBlock(16, 32, 2),
                                    BasicBlock(32, 64, 2), BasicBlock(64, 64, 1))
        self.fc = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(x)


class InceptionBlock(nn.Module):
    """Four branches: 1x1; 1x1 -> 3x3; 1x1 -> 3x3 -> 3x3; 3x3 pool -> 1x1; concatenated."""

    def __init__(self, cin: int, c: int):
        super().__init__()
        self.b1 = conv_bn(cin, c, 1)
        self.b2 = nn.Sequential(conv_bn(cin, c // 2, 1), conv_bn(c // 2, c, 3))
        self.b3 = nn.Sequential(conv_bn(cin, c // 2, 1), conv_bn(c // 2, c, 3), conv_bn(c, c, 3))
        self.b4 = nn.Sequential(nn.AvgPool2d(3, 1, 1), conv_bn(cin, c, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1)


class InceptionNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(conv_bn(3, 24, 3, 2), nn.MaxPool2d(3, 2, 1))
        self.blocks = nn.Sequential(InceptionBlock(24, 16), InceptionBlock(64, 24), nn.MaxPool2d(3, 2, 1),
                                    InceptionBlock(96, 32), InceptionBlock(128, 32))
        self.fc = nn.Linear(128, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1)
        return self.fc(torch.flatten(x, 1))


class SepConv(nn.Module):
    """ReLU -> depthwise k x k -> pointwise 1x1 -> BN, twice, as in NASNet."""

    def __init__(self, c: int, k: int):
        super().__init__()
        self.ops = nn.Sequential(
            nn.ReLU(), nn.Conv2d(c, c, k, 1, k // 2, groups=c, bias=False), nn.Conv2d(c, c, 1, bias=False),
            nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c, k, 1, k // 2, groups=c, bias=False),
            nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops(x)


class NasCell(nn.Module):
    """A NASNet-A normal cell: five pairwise combinations of separable convs, pools and
    identities over the two previous cell outputs, concatenated."""

    def __init__(self, c_prev: int, c_prev2: int, c: int):
        super().__init__()
        self.pre = conv_bn(c_prev, c, 1)
        self.pre2 = conv_bn(c_prev2, c, 1)
        self.s3a, self.s5a = SepConv(c, 3), SepConv(c, 5)
        self.s5b, self.s3b = SepConv(c, 5), SepConv(c, 3)
        self.s3c = SepConv(c, 3)
        self.avg_a, self.avg_b, self.avg_c = nn.AvgPool2d(3, 1, 1), nn.AvgPool2d(3, 1, 1), nn.AvgPool2d(3, 1, 1)
        self.max_a = nn.MaxPool2d(3, 1, 1)

    def forward(self, x: torch.Tensor, x_prev: torch.Tensor) -> torch.Tensor:
        h, p = self.pre(x), self.pre2(x_prev)
        y1 = self.s5a(h) + self.s3a(p)
        y2 = self.s5b(p) + self.s3b(p)
        y3 = self.avg_a(h) + p
        y4 = self.avg_b(p) + self.avg_c(p)
        y5 = self.s3c(h) + self.max_a(h)
        return torch.cat([p, y1, y2, y3, y4, y5], 1)


class NASNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(conv_bn(3, 32, 3, 2), nn.MaxPool2d(3, 2, 1), conv_bn(32, 32, 3, 2))
        self.cell1 = NasCell(32, 32, 16)
        self.cell2 = NasCell(96, 32, 16)
        self.reduce = nn.Sequential(nn.AvgPool2d(2, 2), conv_bn(96, 96, 1))
        self.cell3 = NasCell(96, 96, 24)
        self.fc = nn.Linear(144, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stem(x)
        c1 = self.cell1(s, s)
        c2 = self.cell2(c1, s)
        r = self.reduce(c2)
        c3 = self.cell3(r, r)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(F.relu(c3), 1), 1))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        self.block = nn.Sequential(
            nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True), nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_res:
            return x + self.block(x)
        return self.block(x)


class MobileNet(nn.Module):
    """A MobileNetV2-style chain of inverted residuals with depthwise convs."""

    def __init__(self, classes: int = 10):
        super().__init__()
        cfg = [(16, 24, 2, 4), (24, 24, 1, 4), (24, 32, 2, 4), (32, 32, 1, 4), (32, 64, 2, 4),
               (64, 64, 1, 4), (64, 96, 1, 4), (96, 96, 1, 4)]
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(inplace=True))
        self.blocks = nn.Sequential(*[InvertedResidual(*c) for c in cfg])
        self.head = nn.Sequential(nn.Conv2d(96, 256, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU6(inplace=True))
        self.fc = nn.Sequential(nn.Dropout(0.2), nn.Linear(256, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(self.blocks(self.stem(x)))
        return self.fc(x.mean([2, 3]))


class EncoderBlock(nn.Module):
    """Pre-norm transformer encoder block with hand-written multi-head attention."""

    def __init__(self, dim: int = 128, heads: int = 4, mlp: int = 256):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, mlp), nn.Linear(mlp, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, n, self.heads, d // self.heads).transpose(1, 2)
        k = self.k(h).view(b, n, self.heads, d // self.heads).transpose(1, 2)
        v = self.v(h).view(b, n, self.heads, d // self.heads).transpose(1, 2)
        att = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * (d // self.heads) ** -0.5, dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TwoInTwoOut(nn.Module):
    """An image and a feature vector in; class logits and an embedding out."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(conv_bn(3, 16, 3, 2), conv_bn(16, 32, 3, 2))
        self.meta = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.head = nn.Linear(64, 10)
        self.embed = nn.Linear(64, 16)

    def forward(self, image: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.flatten(F.adaptive_avg_pool2d(self.features(image), 1), 1)
        joint = torch.cat([a, self.meta(features)], 1)
        return self.head(joint), F.normalize(self.embed(joint), dim=1)


class ViT(nn.Module):
    """A ViT-style image transformer: 8x8 patches, a class token, learned positions, pre-norm blocks
    on nn.MultiheadAttention (whose traced inference fast path nimble lowers to its ops)."""

    def __init__(self, image: int = 32, patch: int = 8, dim: int = 64, depth: int = 2, heads: int = 4,
                 mlp: int = 128, classes: int = 10):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(dim, heads, mlp) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.patch(image).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp), nn.GELU(), nn.Linear(mlp, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Bert(nn.Module):
    """A BERT-style encoder from code, small and randomly initialized: int64 token ids and an
    attention mask (1 for tokens, 0 for padding) in; the last hidden states and the pooled [CLS]
    vector out."""

    def __init__(self, vocab: int = 100, dim: int = 64, depth: int = 2, heads: int = 4, mlp: int = 128,
                 positions: int = 64):
        super().__init__()
        self.words, self.positions, self.types = nn.Embedding(vocab, dim), nn.Embedding(positions, dim), nn.Embedding(2, dim)
        self.register_buffer("position_ids", torch.arange(positions).unsqueeze(0), persistent=False)
        self.norm = nn.LayerNorm(dim, eps=1e-12)
        self.layers = nn.ModuleList(BertLayer(dim, heads, mlp) for _ in range(depth))
        self.pool = nn.Linear(dim, dim)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = input_ids.shape[1]
        x = self.words(input_ids) + self.positions(self.position_ids[:, :n]) + self.types(torch.zeros_like(input_ids))
        x = self.norm(x)
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0  # 0 for tokens, -1e4 for padding
        for layer in self.layers:
            x = layer(x, bias)
        return x, torch.tanh(self.pool(x[:, 0]))


class BertLayer(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-12), nn.LayerNorm(dim, eps=1e-12)
        self.up, self.down = nn.Linear(dim, mlp), nn.Linear(mlp, dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.heads, d // self.heads).permute(0, 2, 1, 3)

        scores = torch.matmul(split(self.q(x)), split(self.k(x)).transpose(-1, -2)) / (d // self.heads) ** 0.5
        context = torch.matmul(torch.softmax(scores + bias, dim=-1), split(self.v(x)))
        x = self.norm1(x + self.out(context.permute(0, 2, 1, 3).reshape(b, n, d)))
        return self.norm2(x + self.down(F.gelu(self.up(x))))


# name -> (constructor, example input shapes, how it is converted to TorchScript); float32 inputs
MODELS = {
    "resnet": (ResidualCNN, [(1, 3, 224, 224)], "script"),
    "inception": (InceptionNet, [(1, 3, 224, 224)], "trace"),
    "nasnet": (NASNet, [(1, 3, 224, 224)], "trace"),
    "mobilenet": (MobileNet, [(1, 3, 224, 224)], "script"),
    "transformer": (EncoderBlock, [(1, 64, 128)], "trace"),
    "two_io": (TwoInTwoOut, [(1, 3, 64, 64), (1, 8)], "script"),
    "vit": (ViT, [(1, 3, 32, 32)], "trace"),
}
# Models with integer inputs: name -> (constructor, input shapes, input dtypes, how).
TOKEN_MODELS = {
    "bert": (Bert, [(1, 16), (1, 16)], ["int64", "int64"], "trace"),
}


def example_inputs(name: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Inputs a sample model takes: normal floats, or for `bert` token ids and a mask that pads
    the last quarter of the sequence."""
    gen = torch.Generator().manual_seed(seed)
    if name == "bert":
        (b, n), _ = TOKEN_MODELS[name][1]
        mask = torch.ones(b, n, dtype=torch.int64)
        mask[:, n - n // 4:] = 0
        return torch.randint(0, 100, (b, n), generator=gen), mask
    return tuple(torch.randn(s, generator=gen) for s in MODELS[name][1])


def build_module(name: str) -> nn.Module:
    """The sample model `name` as a plain module: seeded, in eval mode, batch norm randomized."""
    torch.manual_seed(0)
    model = (MODELS[name][0] if name in MODELS else TOKEN_MODELS[name][0])().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.1, 0.1)
    return model


def build(name: str) -> torch.jit.ScriptModule:
    """The sample model `name` converted to TorchScript, as its MODELS entry says."""
    how = MODELS[name][2] if name in MODELS else TOKEN_MODELS[name][3]
    model = build_module(name)
    if how == "script":
        return torch.jit.script(model)
    with torch.no_grad():
        return torch.jit.trace(model, example_inputs(name))


def main(argv: list[str]) -> None:
    names = argv or [*MODELS, *TOKEN_MODELS]
    for name in names:
        module = build(name)
        path = HERE / f"{name}.pt"
        torch.jit.save(module, str(path))
        print(f"{path.name}: {path.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main(sys.argv[1:])
