"""The monitor and the recorders on Hugging Face BERT and GPT-2 built from tiny configs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.models import scalars
from lightning.pytorch.loggers import TensorBoardLogger
from realmodels.models import (
    GPT2LM,
    QUIET,
    SEQ_LEN,
    VOCAB,
    BertClassifier,
    BertEncoder,
    StepCapture,
    modules_of_type,
    stats_of,
    token_loader,
)
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_recorder import FeatureStatsMonitor, HealthMonitor, RecorderCallback, RecorderManager
from lightning_recorder.errors import UnknownSourceError

transformers = pytest.importorskip("transformers")

STATS = ("mean", "std", "min", "max", "abs_mean", "zero_fraction", "nonfinite")
GPT2_BLOCK = "transformers.models.gpt2.modeling_gpt2.GPT2Block"


def fit(
    tmp_path: Path,
    model: pl.LightningModule,
    monitor: pl.Callback,
    reference: StepCapture,
    steps: int = 4,
) -> dict[str, dict[int, float]]:
    logger = TensorBoardLogger(tmp_path, name="run")
    trainer = pl.Trainer(
        **QUIET, logger=logger, max_steps=steps, log_every_n_steps=2, callbacks=[monitor, reference]
    )
    trainer.fit(model, token_loader(n=4 * steps))
    return scalars(logger.log_dir)


def check(
    logged: dict[str, dict[int, float]],
    monitor: FeatureStatsMonitor,
    expected: dict[str, list[torch.Tensor]],
    step: int,
    stats: tuple[str, ...] = STATS,
) -> None:
    """Logged statistics equal the direct ones: 1e-5 relative covers float32 summation and
    TensorBoard's float32 storage (documented error about 1e-6); min/max/counts are exact."""
    for name, tensors in expected.items():
        want = stats_of(tensors)
        want["numel"] = float(sum(t.numel() for t in tensors))
        for stat in stats:
            torch.testing.assert_close(
                torch.tensor(logged[monitor.tag("train", name, stat)][step], dtype=torch.float64),
                torch.tensor(want[stat], dtype=torch.float64),
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, n=name, s=stat: f"{n} {s}: {m}",
            )


# ------------------------------------------------------------------ 2. class names
def test_dotted_class_path_selects_gpt2_blocks(tmp_path: Path) -> None:
    model = GPT2LM()
    blocks = list(modules_of_type(model, transformers.models.gpt2.modeling_gpt2.GPT2Block))
    assert blocks == ["model.transformer.h.0", "model.transformer.h.1"]
    monitor = FeatureStatsMonitor([GPT2_BLOCK], histograms=False, parameters=False)
    reference = StepCapture(blocks)
    logged = fit(tmp_path, model, monitor, reference)
    for step in (1, 3):
        check(logged, monitor, reference.outputs[step], step)


def test_bare_class_name_selects_gpt2_blocks(tmp_path: Path) -> None:
    model = GPT2LM()
    blocks = ["model.transformer.h.0", "model.transformer.h.1"]
    monitor = FeatureStatsMonitor(["GPT2Block"], histograms=False, parameters=False)
    reference = StepCapture(blocks)
    logged = fit(tmp_path, model, monitor, reference)
    check(logged, monitor, reference.outputs[1], 1)


def test_bare_class_name_selects_bert_layers() -> None:
    model = BertClassifier()
    manager = RecorderManager({"layers": {"type": "ModuleOutputs", "source": "BertLayer"}})
    manager.initialize(model)
    try:
        streams = [stream.name for _, stream in manager.streams()]
    finally:
        manager.release()
    assert streams == ["model.bert.encoder.layer.0", "model.bert.encoder.layer.1"]


def test_unknown_bert_name_suggests_close_module_names() -> None:
    manager = RecorderManager({"x": {"type": "ModuleOutputs", "source": "bert.encoder.layer.0"}})
    with pytest.raises(UnknownSourceError, match=r"'model\.bert\.encoder\.layer\.0'"):
        manager.initialize(BertClassifier())


def test_unknown_bert_class_name_suggests_close_class_names() -> None:
    manager = RecorderManager({"x": {"type": "ModuleOutputs", "source": "BertLayers"}})
    with pytest.raises(UnknownSourceError, match=r"(?s)module names.*class(es)?[^.]*'BertLayer'"):
        manager.initialize(BertClassifier())


class TiedWeight(pl.Callback):
    """Reference: GPT-2's tied embedding before and after each optimizer step, and its gradient."""

    def __init__(self) -> None:
        self.before: dict[int, torch.Tensor] = {}
        self.grad: dict[int, torch.Tensor] = {}
        self.after: dict[int, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, opt: Any) -> None:
        weight = pl_module.model.lm_head.weight
        self.before[trainer.global_step] = weight.detach().double().clone()
        self.grad[trainer.global_step] = weight.grad.detach().double().clone()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self.after[trainer.global_step - 1] = pl_module.model.lm_head.weight.detach().double()


def test_monitored_lm_head_logs_its_tied_weight_under_its_first_name(tmp_path: Path) -> None:
    # lm_head.weight is transformer.wte.weight (tied): named_parameters() lists it once, under
    # its first name, and the monitor of lm_head logs it under that name
    model = GPT2LM()
    assert model.model.lm_head.weight is model.model.transformer.wte.weight
    monitor = FeatureStatsMonitor(["model.lm_head"], histograms=False)
    reference = TiedWeight()
    logged = fit(tmp_path, model, monitor, reference, steps=2)  # type: ignore[arg-type]
    name = "model.transformer.wte.weight"
    assert {t for t in logged if t.endswith(("norm", "update_ratio"))} == {
        monitor.tag("train", name, stat) for stat in ("norm", "grad_norm", "update_ratio")
    }
    before, after = reference.before[1], reference.after[1]
    expected = {
        "norm": after.norm().item(),
        "grad_norm": reference.grad[1].norm().item(),
        "update_ratio": ((after - before).norm() / before.norm()).item(),
    }
    for stat, value in expected.items():
        # float32 norms of float32 values against float64 ones, stored as float32: 1e-5 relative
        assert logged[monitor.tag("train", name, stat)][1] == pytest.approx(value, rel=1e-5)


def test_second_name_of_tied_weight_in_parameters_says_which_to_name(tmp_path: Path) -> None:
    model = GPT2LM()
    monitor = FeatureStatsMonitor(["model.lm_head"], parameters="model.lm_head.weight")
    trainer = pl.Trainer(
        **QUIET, logger=TensorBoardLogger(tmp_path), max_steps=1, callbacks=[monitor]
    )
    with pytest.raises(
        UnknownSourceError,
        match=r"`parameters` of FeatureStatsMonitor: .*'model\.lm_head\.weight' is a second "
        r"name of the parameter 'model\.transformer\.wte\.weight'.*Record "
        r"'model\.transformer\.wte\.weight'",
    ):
        trainer.fit(model, token_loader())
    assert not any(m._forward_hooks for m in model.modules())  # nothing left installed


# ------------------------------------------------------------------ 3. path into outputs
PATHS: list[tuple[str, Any]] = [
    ("net", "last_hidden_state"),
    ("net", "hidden_states.2"),
    ("net.encoder.layer.0.attention.self", 0),
]


def test_recorder_callback_path_into_bert_outputs() -> None:
    seen: dict[str, torch.Tensor] = {}

    class Reader(BertEncoder):
        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            callback = RecorderCallback.of(self)
            seen.update({f"r{i}": callback.get_record_data(f"r{i}") for i in range(3)})
            ids, mask, _ = batch
            with torch.no_grad():
                out = self.net(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            seen["last"], seen["h2"] = out.last_hidden_state, out.hidden_states[2]
            return loss

    configs = {
        f"r{i}": {"type": "ModuleOutputs", "source": s, "path": p, "keep": "first"}
        for i, (s, p) in enumerate(PATHS)
    }
    attention = StepCapture(["net.encoder.layer.0.attention.self"], path=0)
    trainer = pl.Trainer(
        **QUIET, logger=False, max_steps=1, callbacks=[RecorderCallback(configs), attention]
    )
    trainer.fit(Reader(), token_loader())
    # same weights, same inputs, same float32 kernels in eval-free (dropout 0) mode: equal to
    # rounding; 1e-6 allows a different kernel choice between the two calls
    torch.testing.assert_close(seen["r0"], seen["last"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(seen["r1"], seen["h2"], rtol=1e-6, atol=1e-6)
    first_call = attention.outputs[0]["net.encoder.layer.0.attention.self"][0]
    torch.testing.assert_close(seen["r2"], first_call, rtol=0, atol=0)  # the same tensor


def test_monitor_path_into_bert_outputs(tmp_path: Path) -> None:
    # Proposed form, as RecorderCallback's configs: {"source": ..., "path": ...};
    # tags "{prefix}/{stage}/{module}/{path}/{stat}"
    sources = [{"source": s, "path": p} for s, p in PATHS]
    monitor = FeatureStatsMonitor(sources, histograms=False, parameters=False)
    model = BertEncoder()
    references = [StepCapture([s], path=p) for s, p in PATHS]
    logger = TensorBoardLogger(tmp_path, name="run")
    trainer = pl.Trainer(
        **QUIET, logger=logger, max_steps=2, log_every_n_steps=2, callbacks=[monitor, *references]
    )
    trainer.fit(model, token_loader())
    logged = scalars(logger.log_dir)
    for (source, path), reference in zip(PATHS, references, strict=True):
        check(logged, monitor, {f"{source}/{path}": reference.outputs[1][source]}, 1)


def test_path_into_gpt2_cache_attributes() -> None:
    # use_cache=True: the keys of the second layer live in an attribute of the cache object's
    # instance (transformers' DynamicCache: `layers[i].keys`; before 4.54: `key_cache[i]`)
    model = GPT2LM().model
    ids = token_loader().dataset.tensors[0][:4]
    cache = model(input_ids=ids, use_cache=True).past_key_values
    path = "past_key_values." + ("layers.1.keys" if hasattr(cache, "layers") else "key_cache.1")
    manager = RecorderManager(
        {"keys": {"type": "ModuleOutputs", "source": "transformer", "path": path}}
    )
    manager.initialize(model)
    try:
        with manager:
            out = model(input_ids=ids, use_cache=True)
        recorded = manager.get_recorder("keys").get_record_data()
    finally:
        manager.release()
    cache = out.past_key_values
    expected = cache.layers[1].keys if hasattr(cache, "layers") else cache.key_cache[1]
    assert recorded.shape == (4, 2, SEQ_LEN, 16)  # batch, heads, tokens, head width
    torch.testing.assert_close(recorded, expected, rtol=0, atol=0)  # the same tensor


# ------------------------------------------------------------------ 5. gradient checkpointing
class CheckpointedMLP(pl.LightningModule):
    """A block run through ``torch.utils.checkpoint`` (non-reentrant), then a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(100, 16)
        self.block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 5)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, _, labels = batch
        x = self.embed(ids).requires_grad_()
        h = checkpoint(self.block, x, use_reentrant=False)
        return nn.functional.cross_entropy(self.head(h.mean(1)), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_checkpointed_block_recorded_once(tmp_path: Path) -> None:
    names = ["block.0", "block.1", "block.2"]
    monitor = FeatureStatsMonitor(
        names, histograms=False, parameters=False, stats=[*STATS, "numel"]
    )
    reference = StepCapture(names)
    logged = fit(tmp_path, CheckpointedMLP(), monitor, reference)
    for step in (1, 3):
        calls = reference.outputs[step]
        # forward + recomputation in backward (which stops early, before block.2)
        assert [len(calls[n]) for n in names] == [2, 2, 1]
        check(logged, monitor, {n: calls[n][:1] for n in names}, step, (*STATS, "numel"))


def test_gpt2_gradient_checkpointing_statistics(tmp_path: Path) -> None:
    model = GPT2LM(checkpointing=True)
    assert model.model.is_gradient_checkpointing
    inner = ["model.transformer.h.0.ln_1", "model.transformer.h.1.mlp.c_fc"]
    names = ["model.transformer.h.0", "model.transformer.h.1", *inner]
    monitor = FeatureStatsMonitor(
        names, histograms=False, parameters=False, stats=[*STATS, "numel"]
    )
    reference = StepCapture(names)
    logged = fit(tmp_path, model, monitor, reference)
    batch, seq, width = 4, 8, 32
    for step in (1, 3):
        # the blocks' forwards are checkpointed: their inner modules run again in backward
        assert [len(reference.outputs[step][n]) for n in inner] == [2, 2]
        for name in names:
            numel = logged[monitor.tag("train", name, "numel")][step]
            mult = 4 if name.endswith("c_fc") else 1  # the MLP's inner width is 4 * n_embd
            assert numel == batch * seq * width * mult  # one call per step, not two
        check(logged, monitor, {n: reference.outputs[step][n][:1] for n in names}, step)


# ------------------------------------------------------------------ HealthMonitor
class ViTClassifier(pl.LightningModule):
    """``ViTForImageClassification`` as ``self.model``, fed Hugging Face batches (mappings)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.ViTConfig(
            image_size=8,
            patch_size=4,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=24,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        self.model = transformers.ViTForImageClassification(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(pixel_values=batch["pixel_values"], labels=batch["labels"]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_health_monitor_names_a_bad_batch_feature(tmp_path: Path) -> None:
    # Hugging Face's collators and image processors give a BatchFeature (a mapping, not a
    # dict): its NaN is the batch's, and the evidence holds the batch
    from safetensors.torch import load_file

    x, y = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0)), torch.arange(8) % 3
    x[5, 0, 2, 3] = float("nan")  # in batch 1

    def collate(rows: list[int]) -> Any:
        return transformers.BatchFeature({"pixel_values": x[rows], "labels": y[rows]})

    monitor = HealthMonitor(on_nonfinite="skip")
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=4, collate_fn=collate)
    trainer = pl.Trainer(
        **QUIET, logger=False, default_root_dir=tmp_path, max_steps=2, callbacks=[monitor]
    )
    trainer.fit(ViTClassifier(), loader)
    [event] = monitor.events
    assert (event.step, event.module, event.path, event.producer) == (
        1,
        None,
        "batch.pixel_values",
        False,
    )
    assert event.counts == {"nan": 1, "posinf": 0, "neginf": 0}
    assert event.evidence is not None
    tensors = load_file(Path(event.evidence) / "tensors.safetensors")
    torch.testing.assert_close(tensors["batch.pixel_values"], x[4:], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(tensors["batch.labels"], y[4:])


def test_health_monitor_names_code_between_submodules_of_a_bert_layer(tmp_path: Path) -> None:
    # BertLayer's code between its submodules `intermediate` and `output` (BertOutput) makes the
    # NaN: the message says so, though the tensor's path starts with the submodule's name
    model = BertClassifier()
    layer = model.model.bert.encoder.layer[1]
    assert hasattr(layer, "feed_forward_chunk")  # BertLayer: intermediate, then output

    def feed_forward_chunk(attention_output: torch.Tensor) -> torch.Tensor:
        hidden = layer.intermediate(attention_output)
        if model.trainer.global_step == 1:
            hidden = hidden * float("nan")  # the layer's own code, between its submodules
        return layer.output(hidden, attention_output)

    layer.feed_forward_chunk = feed_forward_chunk
    monitor = HealthMonitor(on_nonfinite="skip")
    trainer = pl.Trainer(
        **QUIET, logger=False, default_root_dir=tmp_path, max_steps=2, callbacks=[monitor]
    )
    trainer.fit(model, token_loader())
    [event] = monitor.events
    assert (event.step, event.module, event.direction, event.path, event.producer) == (
        1,
        "model.bert.encoder.layer.1",
        "forward",
        "output.input.hidden_states",
        True,
    )
    assert event.message.startswith(
        "Code of `model.bert.encoder.layer.1` between its submodules made non-finite values at "
        "`output.input.hidden_states` at step 1"
    )
    assert event.details["submodule"] == "output"


class LlamaLM(pl.LightningModule):
    """``LlamaForCausalLM`` as ``self.model``, trained on next-token prediction."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        self.model = transformers.LlamaForCausalLM(config)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class NaNGradient(torch.autograd.Function):
    """The identity forward; backward, a NaN gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


def test_health_monitor_names_the_gradient_of_llamas_input_layernorm_output(
    tmp_path: Path,
) -> None:
    # A hook on `input_layernorm` (a submodule whose name starts with "input") passes its output
    # on through a function whose backward makes NaN: outside any submodule, in the layer's
    # call. The message names the gradient of `input_layernorm.output`, not an input of its own.
    model = LlamaLM()
    layer = model.model.model.layers[1]

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        return NaNGradient.apply(output) if model.trainer.global_step == 1 else None

    layer.input_layernorm.register_forward_hook(hook)
    monitor = HealthMonitor(on_nonfinite="skip")
    trainer = pl.Trainer(
        **QUIET, logger=False, default_root_dir=tmp_path, max_steps=2, callbacks=[monitor]
    )
    trainer.fit(model, token_loader())
    [event] = monitor.events
    assert (event.step, event.module, event.direction, event.path) == (
        1,
        "model.model.layers.1",
        "backward",
        "input_layernorm.output",
    )
    assert event.message.startswith(
        "`model.model.layers.1` made non-finite values in its backward, in the gradient of "
        "`input_layernorm.output` (from a finite output gradient) at step 1"
    )
    assert event.details["submodule"] == "input_layernorm"
