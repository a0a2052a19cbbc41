"""Architectures written elsewhere, built tiny for the tests: a ResNet, BERT and GPT-2.

The ResNet follows torchvision's layout and module names (``conv1, bn1, relu, maxpool,
layer1..layer4, avgpool, fc``; blocks with ``BatchNorm2d`` followed by ``ReLU(inplace=True)``,
``out += identity`` and a ``downsample`` branch ``Sequential(conv1x1, BatchNorm2d)``), so that a
name or pattern behaves here as it does on ``torchvision.models.resnet18``. The transformers
models are Hugging Face's own classes from tiny configs (no download).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

QUIET: dict[str, Any] = {
    "accelerator": "cpu",
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "num_sanity_val_steps": 0,
}

IMAGE_SIZE = 16
NUM_CLASSES = 5
VOCAB = 100
SEQ_LEN = 8


# ---------------------------------------------------------------------- ResNet
def conv3x3(inplanes: int, planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)


def conv1x1(inplanes: int, planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet at toy size: ``widths`` channels per stage, ``layers`` blocks each."""

    def __init__(
        self,
        block: type[BasicBlock | Bottleneck] = BasicBlock,
        layers: tuple[int, int, int, int] = (1, 1, 1, 1),
        widths: tuple[int, int, int, int] = (4, 8, 8, 8),
        num_classes: int = NUM_CLASSES,
    ) -> None:
        super().__init__()
        self.inplanes = widths[0]
        self.conv1 = nn.Conv2d(3, self.inplanes, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, widths[0], layers[0])
        self.layer2 = self._make_layer(block, widths[1], layers[1], stride=2)
        self.layer3 = self._make_layer(block, widths[2], layers[2], stride=2)
        self.layer4 = self._make_layer(block, widths[3], layers[3], stride=1)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[3] * block.expansion, num_classes)

    def _make_layer(
        self, block: type[BasicBlock | Bottleneck], planes: int, blocks: int, stride: int = 1
    ) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        modules: list[nn.Module] = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        modules += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet_basic(width: int = 4) -> ResNet:
    return ResNet(BasicBlock, (1, 1, 1, 1), (width, 2 * width, 2 * width, 2 * width))


def resnet_bottleneck(width: int = 2) -> ResNet:
    return ResNet(Bottleneck, (1, 1, 1, 1), (width, width, width, width))


class ImageClassifier(pl.LightningModule):
    """A LightningModule holding a ResNet as ``self.net``."""

    def __init__(self, net: nn.Module | None = None, lr: float = 0.05) -> None:
        super().__init__()
        self.net = net if net is not None else resnet_basic()
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def images(n: int = 16, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    return TensorDataset(x, torch.randint(0, NUM_CLASSES, (n,), generator=g))


def image_loader(n: int = 16, batch_size: int = 4, seed: int = 0) -> DataLoader:
    return DataLoader(images(n, seed), batch_size=batch_size, shuffle=False)


# ---------------------------------------------------------------------- transformers
def bert_config(**overrides: Any) -> Any:
    import transformers

    options: dict[str, Any] = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 37,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
        "num_labels": NUM_CLASSES,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }
    options.update(overrides)
    return transformers.BertConfig(**options)


def gpt2_config(**overrides: Any) -> Any:
    import transformers

    options: dict[str, Any] = {
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 2,
        "vocab_size": VOCAB,
        "n_positions": 64,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    options.update(overrides)
    return transformers.GPT2Config(**options)


def tokens(n: int = 8, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ_LEN), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # one padded sequence
    return TensorDataset(ids, mask, torch.randint(0, NUM_CLASSES, (n,), generator=g))


def token_loader(n: int = 8, batch_size: int = 4, seed: int = 0) -> DataLoader:
    return DataLoader(tokens(n, seed), batch_size=batch_size, shuffle=False)


class BertClassifier(pl.LightningModule):
    """``BertForSequenceClassification`` as ``self.model``, called Hugging Face style."""

    def __init__(self, config: Any = None, lr: float = 1e-3) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        self.model = transformers.BertForSequenceClassification(config or bert_config())
        self.lr = lr

    def forward(self, **inputs: torch.Tensor) -> Any:
        return self.model(**inputs)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, mask, labels = batch
        loss = self(input_ids=ids, attention_mask=mask, labels=labels).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class BertEncoder(pl.LightningModule):
    """A bare ``BertModel`` as ``self.net`` with a classifier head on the first token."""

    def __init__(self, config: Any = None, lr: float = 1e-3, seed: int = 0) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(seed)
        config = config or bert_config()
        self.net = transformers.BertModel(config, add_pooling_layer=False)
        self.head = nn.Linear(config.hidden_size, NUM_CLASSES)
        self.lr = lr

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.net(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True
        )
        return self.head(out.last_hidden_state[:, 0])

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, mask, labels = batch
        return F.cross_entropy(self(ids, mask), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class GPT2LM(pl.LightningModule):
    """``GPT2LMHeadModel`` as ``self.model``, trained on next-token prediction."""

    def __init__(self, config: Any = None, lr: float = 1e-3, checkpointing: bool = False) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        self.model = transformers.GPT2LMHeadModel(config or gpt2_config())
        if checkpointing:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.lr = lr

    def forward(self, input_ids: torch.Tensor) -> Any:
        return self.model(input_ids=input_ids, labels=input_ids)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(batch[0]).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


# ---------------------------------------------------------------------- references
def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).double() for t in tensors])


def stats_of(tensors: list[torch.Tensor]) -> dict[str, float]:
    """The monitor's statistics as plain torch defines them (finite elements, sample std)."""
    values = flat(tensors)
    finite = values[torch.isfinite(values)]
    return {
        "mean": finite.mean().item(),
        "std": finite.std().item(),
        "min": finite.min().item(),
        "max": finite.max().item(),
        "abs_mean": finite.abs().mean().item(),
        "zero_fraction": (values == 0).double().mean().item(),
        "nonfinite": float((~torch.isfinite(values)).sum().item()),
    }


def modules_of_type(model: nn.Module, kind: type) -> Iterator[str]:
    return (name for name, module in model.named_modules() if isinstance(module, kind))


class StepCapture(pl.Callback):
    """Reference: copies of the outputs of named modules in every training step, by step."""

    def __init__(self, names: list[str], path: Any = None) -> None:
        self.names, self.path = names, path
        self.outputs: dict[int, dict[str, list[torch.Tensor]]] = {}
        self.losses: dict[int, float] = {}
        self._handles: list[Any] = []
        self._step = -1

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        modules = dict(pl_module.named_modules())
        self._handles = [modules[n].register_forward_hook(self._hook(n)) for n in self.names]

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if module.training and self._step >= 0:
                value = output if self.path is None else pick(output, self.path)
                per_step = self.outputs.setdefault(self._step, {})
                per_step.setdefault(name, []).append(value.detach().clone())

        return hook

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *a: Any
    ) -> None:
        self.losses[self._step] = float(outputs["loss"])
        self._step = -1

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def pick(value: Any, path: Any) -> torch.Tensor:
    """``value`` followed along a path of keys / indices (dotted string or a single key)."""
    keys = path.split(".") if isinstance(path, str) else [path]
    for key in keys:
        if isinstance(key, str) and key.isdigit():
            key = int(key)
        value = (
            value[key]
            if not isinstance(key, str) or not hasattr(value, key)
            else getattr(value, key)
        )
    return value
