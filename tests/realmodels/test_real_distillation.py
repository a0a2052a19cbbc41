"""FeatureDistillation between real architectures: ResNet -> ResNet, BERT -> smaller BERT."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from realmodels.models import (
    GPT2LM,
    QUIET,
    BertEncoder,
    ImageClassifier,
    bert_config,
    gpt2_config,
    image_loader,
    resnet_basic,
    token_loader,
)
from torch import nn
from torch.nn import functional as F

from lightning_recorder import FeatureDistillation
from lightning_recorder.errors import RecorderConfigError

pytest.importorskip("transformers")


class Snapshot(pl.Callback):
    """Copies of the student and of the connectors at the start of the last step."""

    def __init__(self, distill: FeatureDistillation, step: int) -> None:
        self.distill, self.step = distill, step
        self.student: dict[str, torch.Tensor] = {}
        self.connectors: dict[str, nn.Module] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, i: int) -> None:
        if trainer.global_step == self.step:
            self.batch = batch
            self.student = copy.deepcopy(pl_module.state_dict())
            self.connectors = copy.deepcopy(dict(self.distill.connectors))


def features(model: nn.Module, names: list[str], *args: Any) -> dict[str, torch.Tensor]:
    """The first output (first item of a tuple) of each named module in one forward."""
    modules, out = dict(model.named_modules()), {}
    handles = [
        modules[n].register_forward_hook(
            lambda m, a, o, n=n: out.setdefault(n, (o[0] if isinstance(o, tuple) else o).clone())
        )
        for n in names
    ]
    try:
        model(*args)
    finally:
        for handle in handles:
            handle.remove()
    return out


def fit_and_check(
    student: pl.LightningModule,
    fresh: pl.LightningModule,
    teacher: nn.Module,
    pairs: dict[str, str],
    loader: Any,
    tmp_path: Any,
) -> None:
    """Fit 3 steps; the last step's logged terms equal a direct computation from snapshots."""
    distill = FeatureDistillation(teacher, pairs)
    snapshot = Snapshot(distill, step=2)
    trainer = pl.Trainer(
        **{**QUIET, "enable_checkpointing": True},
        default_root_dir=tmp_path,
        logger=False,
        max_steps=3,
        callbacks=[distill, snapshot],
    )
    trainer.fit(student, loader)
    logged = {p: trainer.logged_metrics[f"distill/{p}"] for p in pairs}
    assert all(torch.isfinite(v) for v in logged.values())

    replay = copy.deepcopy(student)
    replay.load_state_dict(snapshot.student)
    replay.train()  # as in the step (BatchNorm on batch statistics)
    inputs = snapshot.batch[:-1]
    s = features(replay, list(pairs), *inputs)
    t = features(teacher.eval(), list(pairs.values()), *inputs)
    for pair, t_name in pairs.items():
        with torch.no_grad():
            direct = F.mse_loss(snapshot.connectors[pair](s[pair]), t[t_name])
        # the same float32 ops on the same weights and inputs, possibly another kernel order
        torch.testing.assert_close(logged[pair], direct, rtol=1e-5, atol=1e-7)

    # the student's checkpoint holds the student only and loads strictly into a fresh one
    path = trainer.checkpoint_callback.best_model_path
    state = torch.load(path, weights_only=True)["state_dict"]
    fresh.load_state_dict(state, strict=True)
    for key, value in student.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[key], value, rtol=0, atol=0)


def test_resnet_to_narrower_resnet(tmp_path: Any) -> None:
    torch.manual_seed(1)
    teacher = resnet_basic(8)
    torch.manual_seed(0)
    pairs = {f"net.layer{i}": f"layer{i}" for i in range(1, 5)}
    fit_and_check(
        ImageClassifier(resnet_basic(4)),
        ImageClassifier(resnet_basic(4)),
        teacher,
        pairs,
        image_loader(n=12),
        tmp_path,
    )


def test_bert_to_smaller_bert_hidden_states(tmp_path: Any) -> None:
    teacher = BertEncoder(seed=1).net
    small = bert_config(hidden_size=16, num_hidden_layers=1, intermediate_size=20)
    # hidden_states[2] of the teacher is the output of its encoder.layer.1 (a tensor)
    pairs = {"net.encoder.layer.0": "encoder.layer.1", "net.embeddings": "embeddings"}
    fit_and_check(
        BertEncoder(small), BertEncoder(small), teacher, pairs, token_loader(n=12), tmp_path
    )


def test_bert_last_hidden_state_by_path(tmp_path: Any) -> None:
    # Proposed form: a pair's side may be {"source": module, "path": key}, as in RecorderCallback
    teacher = BertEncoder(seed=1).net
    small = bert_config(hidden_size=16, num_hidden_layers=1, intermediate_size=20)
    distill = FeatureDistillation(
        teacher,
        {"net.encoder": {"source": "encoder", "path": "last_hidden_state"}},
    )
    trainer = pl.Trainer(**QUIET, logger=False, max_steps=2, callbacks=[distill])
    trainer.fit(BertEncoder(small), token_loader())
    assert torch.isfinite(trainer.logged_metrics["distill/net.encoder"])


@pytest.mark.parametrize("reentrant", [True, False])
def test_pair_inside_a_reentrant_checkpoint_warns_that_the_student_gets_no_gradient(
    reentrant: bool,
) -> None:
    # use_reentrant=True runs each block's forward without gradients (the block's output gets
    # them from the recomputation): a pair inside a block would train its connector only
    import transformers

    student = GPT2LM(gpt2_config(n_embd=16))
    student.model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": reentrant}
    )
    torch.manual_seed(1)
    teacher = transformers.GPT2LMHeadModel(gpt2_config())
    pairs = {
        "model.transformer.h.1.mlp": "transformer.h.1.mlp",  # inside the checkpointed block
        "model.transformer.h.1": "transformer.h.1",  # the block: its output has gradients
    }
    distill = FeatureDistillation(teacher, pairs)
    trainer = pl.Trainer(**QUIET, logger=False, max_steps=2, callbacks=[distill])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(student, token_loader())
    messages = [str(w.message) for w in caught if "does not require grad" in str(w.message)]
    if reentrant:
        assert len(messages) == 1  # once, for the pair inside the block
        assert "'model.transformer.h.1.mlp' -> 'transformer.h.1.mlp'" in messages[0]
        assert "use_reentrant=False" in messages[0]
    else:
        assert messages == []


def test_teacher_checkpoint_holding_a_tied_weight_once_loads(tmp_path: Any) -> None:
    # Hugging Face's save_pretrained writes a tied weight once: lm_head.weight is
    # transformer.wte.weight, and the file holds the latter only
    import transformers

    torch.manual_seed(1)
    trained = transformers.GPT2LMHeadModel(gpt2_config())
    state = {k: v for k, v in trained.state_dict().items() if k != "lm_head.weight"}
    torch.save(state, tmp_path / "teacher.pt")
    torch.manual_seed(2)
    teacher = transformers.GPT2LMHeadModel(gpt2_config())
    pairs = {"model.lm_head": "lm_head"}
    FeatureDistillation(teacher, pairs, teacher_checkpoint=tmp_path / "teacher.pt")
    assert teacher.lm_head.weight is teacher.transformer.wte.weight  # still tied
    for key, value in trained.state_dict().items():
        torch.testing.assert_close(teacher.state_dict()[key], value, rtol=0, atol=0)
    # a weight that is missing under every name is still an error
    del state["transformer.wpe.weight"]
    torch.save(state, tmp_path / "short.pt")
    with pytest.raises(RecorderConfigError, match=r"Missing key\(s\).*transformer\.wpe\.weight"):
        FeatureDistillation(teacher, pairs, teacher_checkpoint=tmp_path / "short.pt")


class TwoOut(nn.Module):
    """Returns ``(x, 2x + 1)``: the path decides which one is the teacher's feature."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, 2 * x + 1


class TupleTeacher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.two = TwoOut()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.two(x)[0]


class LinearStudent(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_teacher_path_selects_one_tensor_of_a_tuple() -> None:
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def loss(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        seen.append((s.detach(), t))
        return (s - t).square().mean()

    distill = FeatureDistillation(TupleTeacher(), {"body": {"source": "two", "path": 1}}, loss)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4))
    trainer = pl.Trainer(**QUIET, logger=False, max_steps=2, callbacks=[distill])
    trainer.fit(LinearStudent(), torch.utils.data.DataLoader(data, batch_size=4))
    assert len(seen) == 2
    for step, (_, t) in enumerate(seen):
        x = data.tensors[0][4 * step : 4 * step + 4]
        # the same float32 operations on the same values: exact
        torch.testing.assert_close(t, 2 * x + 1, rtol=0, atol=0)


def test_teacher_side_dict_with_an_unknown_key_is_rejected() -> None:
    with pytest.raises(RecorderConfigError, match=r"pair 'body'.*'source' and 'path'.*'paht'"):
        FeatureDistillation(TupleTeacher(), {"body": {"source": "two", "paht": 1}})
    with pytest.raises(RecorderConfigError, match=r"pair 'body'.*'source' key"):
        FeatureDistillation(TupleTeacher(), {"body": {"path": 1}})
    with pytest.raises(RecorderConfigError, match=r"'tw\*'.*exact module name"):
        FeatureDistillation(TupleTeacher(), {"body": {"source": "tw*", "path": 1}})


def test_pattern_in_pairs_rejected_at_construction() -> None:
    # A pattern would pair many features with many: rejected before anything is installed.
    with pytest.raises(RecorderConfigError, match=r"'net\.layer\*'.*exact module name"):
        FeatureDistillation(resnet_basic(8), {"net.layer*": "layer*"})


# ------------------------------------------------------------------ 8. teacher problems
class NaNTeacher(nn.Module):
    """A ResNet whose layer2 output turns non-finite."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = resnet_basic(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def nan_teacher() -> NaNTeacher:
    teacher = NaNTeacher()
    teacher.inner.layer2.register_forward_hook(lambda m, a, o: o * float("nan"))
    return teacher


def test_nonfinite_teacher_feature_warns_naming_the_pair() -> None:
    distill = FeatureDistillation(nan_teacher(), {"net.layer2": "inner.layer2"})
    trainer = pl.Trainer(**QUIET, logger=False, max_steps=2, callbacks=[distill])
    with pytest.warns(UserWarning, match=r"non-finite.*'net\.layer2'.*'inner\.layer2'") as caught:
        trainer.fit(ImageClassifier(resnet_basic(4)), image_loader())
    assert sum("non-finite" in str(w.message) for w in caught) == 1  # first occurrence only


def test_nonfinite_teacher_feature_today_gives_nan_loss() -> None:
    distill = FeatureDistillation(nan_teacher(), {"net.layer2": "inner.layer2"})
    trainer = pl.Trainer(**QUIET, logger=False, max_steps=1, callbacks=[distill])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(ImageClassifier(resnet_basic(4)), image_loader())
    assert torch.isnan(trainer.logged_metrics["distill/net.layer2"])


def test_teacher_that_cannot_take_the_input_points_to_teacher_input() -> None:
    distill = FeatureDistillation(BertEncoder().net, {"net.layer1": "embeddings"})
    trainer = pl.Trainer(**QUIET, logger=False, max_steps=1, callbacks=[distill])
    with pytest.raises(Exception, match=r"teacher.*teacher_input="):
        trainer.fit(ImageClassifier(resnet_basic(4)), image_loader())
