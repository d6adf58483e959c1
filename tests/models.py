"""Tiny models that exercise one behaviour each: of the frontend (scripted in the tests), or of the runtime."""

import torch
import torch.nn as nn

from sample_models.build import InvertedResidual


class DataDependentIf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


class ShapeIfAndLoop(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            x = x + 1
        for _ in range(3):
            x = x * 2
        return x.view(x.size(0), -1)


class UnsupportedOp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.inv(x)


class InPlaceThroughView(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x)
        v = y.view(-1)
        z = y * 2
        v.add_(1)
        return z + y


class ParallelLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.b(x)


def smoothed(module: nn.Module) -> nn.Module:
    """`module` with its kinks taken out, in place: each ReLU and ReLU6 a SiLU, each max pool an
    average pool of its window. A kink's derivative jumps, so a rounding-sized difference in the
    forward (another stream's reduction order, say) can flip one element's gradient path: the
    backward then differs from eager's by 1e-4 to 1e-2 on a rare step. A smooth net's step
    follows eager's within rounding on every step."""
    for name, child in module.named_children():
        if isinstance(child, (nn.ReLU, nn.ReLU6)):
            setattr(module, name, nn.SiLU())
        elif isinstance(child, nn.MaxPool2d):
            setattr(module, name, nn.AvgPool2d(child.kernel_size, child.stride, child.padding))
        else:
            smoothed(child)
    return module


class StochasticNet(nn.Module):
    """Batch norm, dropout and a stochastic-depth residual (torch.empty(...).bernoulli_()), as in
    EfficientNet's training-mode forward."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.branch = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.SiLU(inplace=True))
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        if self.training:
            keep = torch.empty([x.shape[0], 1, 1, 1], dtype=x.dtype, device=x.device).bernoulli_(0.8)
            x = x + self.branch(x) * keep.div_(0.8)
        else:
            x = x + self.branch(x)
        return self.fc(self.drop(x.mean([2, 3])))


class SamePadding(nn.Module):
    """TensorFlow-style "same" padding computed from the input size in Python, as ported models
    do: traced, the size arithmetic becomes aten ops on tensors, with kwarg-only alpha on sub."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, 2)

    def forward(self, x):
        import math

        ih, iw = x.shape[-2:]
        ph = max((math.ceil(ih / 2) - 1) * 2 + 3 - ih, 0)
        pw = max((math.ceil(iw / 2) - 1) * 2 + 3 - iw, 0)
        x = nn.functional.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2])
        return self.conv(x)


class NewZeros(nn.Module):
    """`x.new_zeros(size)` filled in place, as Swin builds its shifted-window mask."""

    def forward(self, x):
        mask = x.new_zeros((1, x.shape[1]))
        mask[:, 1:] = 1.0
        return x * mask + x.new_ones((1, 1)) + x.new_full((1, 1), 2.0)


class DictAndPool3d(nn.Module):
    """A dict of outputs, as torchvision's segmentation models return, and 3-D pooling, as its
    video models use."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        pooled = nn.functional.max_pool3d(y, 2) + nn.functional.avg_pool3d(y, 2)
        return {"out": nn.functional.adaptive_avg_pool3d(pooled, 1).flatten(1), "aux": pooled}


class _Block(nn.Module):
    """torchvision's ResNet BasicBlock, written out here so that the tests need no torchvision."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)) \
            if stride != 1 or cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet18(nn.Module):
    """torchvision.models.resnet18's layers, in its order (stem, four stages of two blocks, pooling,
    classifier)."""

    def __init__(self, classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages.append(nn.Sequential(_Block(cin, cout, stride), _Block(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class Conv1D(nn.Module):
    """GPT-2's linear: rows times a [K, N] weight, plus a bias, viewed back as [..., N]."""

    def __init__(self, k: int, n: int):
        super().__init__()
        self.nf, self.bias = n, nn.Parameter(torch.randn(n))
        self.weight = nn.Parameter(torch.randn(k, n) / k ** 0.5)

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(x.size()[:-1] + (self.nf,))


class FeedForward(nn.Module):
    """GPT-2's MLP and residual: Conv1D, tanh GELU, Conv1D, add."""

    def __init__(self):
        super().__init__()
        self.up, self.down = Conv1D(96, 384), Conv1D(384, 96)

    def forward(self, x):
        h = self.up(x)
        h = 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0))))
        return self.down(h) + x


class DenseBlock(nn.Module):
    """densenet's dense block at odd sizes: each layer concatenates every feature map before it,
    then batch norm, ReLU and a convolution read the result; the block ends with one more cat,
    batch norm and ReLU, and a cat read by two ops (which no kernel may take in)."""

    def __init__(self, channels: int = 5, growth: int = 3, layers: int = 3):
        super().__init__()
        self.stem = nn.Conv2d(channels, channels, 1)  # the parts are activations, in the layout chosen at load
        self.norms = nn.ModuleList(nn.BatchNorm2d(channels + k * growth) for k in range(layers + 1))
        self.convs = nn.ModuleList(nn.Conv2d(channels + k * growth, growth, 3, padding=1, bias=False)
                                   for k in range(layers))
        for norm in self.norms:  # running statistics other than the identity
            nn.init.uniform_(norm.running_mean, -0.5, 0.5)
            nn.init.uniform_(norm.running_var, 0.5, 2.0)
            nn.init.uniform_(norm.weight, 0.5, 1.5)

    def forward(self, x: torch.Tensor):
        features = [self.stem(x)]
        for norm, conv in zip(self.norms, self.convs):
            features.append(conv(torch.relu(norm(torch.cat(features, 1)))))
        joined = torch.cat(features, 1)
        twice = torch.cat(features[1:], 1)
        return torch.relu(self.norms[-1](joined)), twice * 2.0, twice.sum(1)


class WindowMerge(nn.Module):
    """Swin's windows at odd sizes, without attention: the map split into 3x3 windows (a copy),
    a projection of each window's rows, the windows merged back (view, permute, and a reshape
    that copies), and the residual add."""

    def __init__(self, channels: int = 96, window: int = 3):
        super().__init__()
        self.window = window
        self.proj = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        s = self.window
        windows = x.view(b, h // s, s, w // s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, s * s, c)
        rows = self.proj(windows)
        merged = rows.view(b, h // s, w // s, s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        return x + merged


class PaddingMask(nn.Module):
    """Hugging Face's attention mask at odd sizes: the padding mask [B, T] cast to booleans and
    spread to [B, 1, 1, T] by indexing with ranges, and-ed with a causal mask, turned into 0 and
    -inf, and added to scores; `reverse` indexes the keys backwards (a gather, not a view)."""

    def __init__(self, reverse: bool = False):
        super().__init__()
        self.reverse = reverse

    def forward(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t = mask.shape
        keys = torch.arange(t)
        keys = keys.flip(0) if self.reverse else keys
        spread = mask.to(torch.bool)[torch.arange(b)[:, None, None, None], keys[None, None, None, :]]
        causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        return scores + torch.where(causal & spread, 0.0, float("-inf"))


class MobileNetV2Small(nn.Module):
    """torchvision's MobileNetV2 in its kinds of layers, fewer and narrower: a stem, inverted
    residual blocks (the bundled sample's, `sample_models/build.py`) with and without their
    residual, a 1x1 head, pooling, dropout and a linear."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(inplace=True))
        self.blocks = nn.Sequential(InvertedResidual(16, 16, 1, 1), InvertedResidual(16, 24, 2, 6),
                                    InvertedResidual(24, 24, 1, 6), InvertedResidual(24, 32, 2, 6))
        self.head = nn.Sequential(nn.Conv2d(32, 64, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU6(inplace=True))
        self.classifier = nn.Sequential(nn.Dropout(0.0), nn.Linear(64, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(self.blocks(self.stem(x)))
        return self.classifier(nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))


class TinyEncoder(nn.Module):
    """A BERT-shaped classifier, small: token embeddings plus learned positions, one pre-norm
    transformer encoder layer (attention, layer norm, a GELU MLP), the mean over tokens, a linear."""

    def __init__(self, vocab: int = 50, width: int = 32, tokens: int = 8, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(1, tokens, width) * 0.02)
        self.layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, activation="gelu",
                                                batch_first=True, norm_first=True)
        self.head = nn.Linear(width, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.embed(ids) + self.position).mean(1))


class TinyViT(nn.Module):
    """torchvision's VisionTransformer, small: a strided convolution cuts the image into patches,
    a class token and learned positions join them, one pre-norm encoder layer (attention, layer
    norm, a GELU MLP), the class token's row to a linear."""

    def __init__(self, image: int = 16, patch: int = 4, width: int = 32, classes: int = 10):
        super().__init__()
        self.patches = nn.Conv2d(3, width, patch, stride=patch)
        self.token = nn.Parameter(torch.zeros(1, 1, width))
        self.position = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, width) * 0.02)
        self.layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, activation="gelu",
                                                batch_first=True, norm_first=True)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patches(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.token.expand(x.shape[0], -1, -1), x], 1) + self.position
        return self.head(self.layer(x)[:, 0])


class TinyConvNeXt(nn.Module):
    """torchvision's ConvNeXt in its kinds of layers, small: a patchify stem, one block (a depthwise
    7x7 convolution, then channels last: layer norm, a GELU MLP, a learned layer scale, back and a
    residual add), average pooling to 1x1, and a head that layer-norms the channels the way
    ConvNeXt's LayerNorm2d does (permuted to the last dimension and back) before a linear."""

    def __init__(self, width: int = 16, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 4, stride=4)
        self.depthwise = nn.Conv2d(width, width, 7, padding=3, groups=width)
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.scale = nn.Parameter(torch.full((width, 1, 1), 0.1))
        self.pool, self.head_norm, self.head = nn.AdaptiveAvgPool2d(1), nn.LayerNorm(width), nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.down(nn.functional.gelu(self.up(self.norm(self.depthwise(x).permute(0, 2, 3, 1)))))
        x = self.scale * y.permute(0, 3, 1, 2) + x  # laid out as the permuted branch: channels-last strides
        x = self.head_norm(self.pool(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.head(x.flatten(1))


class TinySwin(nn.Module):
    """Swin's moves without attention: a patch embedding, a shifted window block (a roll, the
    windows split off, a GELU MLP per window, merged back, rolled back, the residual add, a layer
    norm) and a patch merging (every other row and column in four ways, concatenated, a layer norm
    and a linear), then a head."""

    def __init__(self, channels: int = 16, window: int = 4, classes: int = 10):
        super().__init__()
        self.window, self.shift = window, window // 2
        self.embed = nn.Conv2d(3, channels, 4, stride=4)
        self.mlp = nn.Sequential(nn.Linear(channels, 2 * channels), nn.GELU(), nn.Linear(2 * channels, channels))
        self.norm, self.merge_norm = nn.LayerNorm(channels), nn.LayerNorm(4 * channels)
        self.reduce, self.head = nn.Linear(4 * channels, 2 * channels), nn.Linear(2 * channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).permute(0, 2, 3, 1)
        b, h, w, c = x.shape
        s = self.window
        y = torch.roll(x, (-self.shift, -self.shift), (1, 2))
        y = y.view(b, h // s, s, w // s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, s * s, c)
        y = self.mlp(y).view(b, h // s, w // s, s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        x = self.norm(x + torch.roll(y, (self.shift, self.shift), (1, 2)))
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        return self.head(self.reduce(self.merge_norm(x)).mean((1, 2)))
