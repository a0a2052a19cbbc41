"""Tests of lightning_recorder.inspector: labels, summary, recording and post-processing."""

from __future__ import annotations

import copy
import gc
import importlib.util
import pickle
import re
from collections.abc import Callable, Iterator

import pytest
import torch
from helpers.docs import DOCS, doctest_room, python_blocks, run_page
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_recorder.inspector as inspector_module
from lightning_recorder._core.hooks import live_hooks
from lightning_recorder.errors import (
    RecorderConfigError,
    RecorderStateError,
    RecordModifiedError,
    UnknownSourceError,
)
from lightning_recorder.inspector import Inspector, LayerRow


def toynet() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3), nn.ReLU())


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2)])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Shared(nn.Module):
    """Calls `fc` and `act` twice."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.Tanh()
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.fc(x))
        x = self.act(self.fc(x))
        return self.out(x)


class Interleaved(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.b = nn.ModuleDict({"x": nn.Linear(4, 4), "y": nn.Linear(4, 4)})
        self.deep = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a[0](x)
        x = self.b["x"](x)
        x = self.a[1](x)
        x = self.deep(x)
        return self.b["y"](x)


class Branchy(nn.Module):
    """Runs `extra` only when the input sum is positive (dynamic control flow)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.extra = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        return self.extra(x) if x.sum() > 0 else x


# --- the seed's documented example -----------------------------------------------------------


def test_scio_toy_example_records_the_direct_computation() -> None:
    net = toynet()
    rnet = Inspector(net, input_size=(1, 5))
    assert "Currently recording: None" in repr(rnet)
    rnet.record((0, 1), (1, 3))
    assert "Currently recording: 0-1, 1-3" in repr(rnet)
    x = torch.rand(1, 5)
    out = rnet(x)
    hidden = net[2](net[1](net[0](x)))
    torch.testing.assert_close(out, net(x))
    assert set(rnet.activations) == {(0, 1), (1, 3)}
    torch.testing.assert_close(rnet.activations[(1, 3)], hidden)
    torch.testing.assert_close(rnet.activations[(0, 1)], torch.relu(hidden))
    assert rnet.activations["1-3"] is rnet.activations[(1, 3)]
    assert rnet.activations[(1, 3)].grad_fn is not None  # attached, as in the seed
    assert rnet.recording == ((0, 1), (1, 3))
    assert dict(rnet.recorded_modules) == {(0, 1): net, (1, 3): net[2]}
    assert list(rnet.recorded_params) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    rnet.release()


def test_scio_summary_table_rows() -> None:
    rnet = Inspector(toynet(), input_size=(1, 5))
    rnet.record("1-3")
    rule = "=" * 89
    assert rnet.summary_text().splitlines() == [
        "Inspector of Sequential",
        rule,
        "Layer (type (var_name): depth-idx)  Input Shape  Output Shape  Param #  Param %  Recorded",
        rule,
        "Sequential (Sequential): 0-1        [1, 5]       [1, 3]             --       --",
        "├─Linear (0): 1-1                   [1, 5]       [1, 4]             24   61.54%",
        "├─ReLU (1): 1-2                     [1, 4]       [1, 4]             --       --",
        "├─Linear (2): 1-3                   [1, 4]       [1, 3]             15   38.46%  ✓",
        "├─ReLU (3): 1-4                     [1, 3]       [1, 3]             --       --",
        rule,
        "Total params: 39",
        "Trainable params: 39",
        "Non-trainable params: 0",
        rule,
        "Currently recording: 1-3",
        rule,
    ]
    assert repr(rnet) == rnet.summary_text()
    rnet.release()


def test_summary_shows_containers_repeated_calls_and_several_shapes() -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return x, x[:, :2], x[:, :1]

    net = nn.Sequential(Pair())
    text = Inspector(net, input_size=(1, 3)).summary_text()
    assert re.search(r"├─Pair \(0\): 1-1 +\[1, 3\] +\[1, 3\], \[1, 2\], … +--", text)
    text = Inspector(Shared(), input_size=(1, 4)).summary_text()
    assert re.search(r"├─Linear \(fc\): 1-3 .* \(recursive\)  +--$", text, flags=re.M)
    assert re.search(r"├─Linear \(fc\): 1-1 .* 20   66.67%$", text, flags=re.M)
    text = Inspector(Blocks(), input_size=(1, 4)).summary_text()
    assert re.search(r"├─ModuleList \(blocks\): 1-2 +\(not called\) +-- +-- +--$", text, flags=re.M)
    assert "│    │    ├─Linear (0): 3-3" in text


class TiedHeadFirst(nn.Module):
    """`head.weight` is `emb.weight`: `emb` owns it in `named_parameters()`, `head` runs first."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        bias_only = self.head(torch.zeros(ids.shape[0], 4))
        return self.head(self.body(self.emb(ids))) + bias_only[:, None]


def shown_percents(text: str) -> list[float]:
    return [float(p) for p in re.findall(r"[ (](\d+\.\d\d)%", text)]  # rows, footer


def test_a_tied_parameter_counts_once_on_its_owner_and_other_rows_say_it_is_shared() -> None:
    net = TiedHeadFirst()
    total = sum(p.numel() for p in net.parameters())  # each tensor once: 40 + 20 + 10
    assert [name for name, _ in net.named_parameters()] == [
        "emb.weight",
        "body.weight",
        "body.bias",
        "head.bias",
    ]
    inspector = Inspector(net, input_size=(2, 3), dtypes=[torch.long])
    rows = {(row.name, row.call): row for row in inspector.layers}
    # counted on emb, the owner in named_parameters() order, though head runs first
    assert (rows["emb", 0].params, rows["emb", 0].shared) == (40, ())
    assert (rows["head", 0].params, rows["head", 0].shared) == (10, ("emb.weight",))
    assert (rows["head", 1].params, rows["head", 1].shared) == (0, ())  # a later call
    assert sum(row.params for row in inspector.layers) == total == 70
    text = inspector.summary_text()
    assert re.search(r"├─Linear \(head\): 1-1 .* 10 \(shared: emb\.weight\)   14\.29%$", text, re.M)
    assert re.search(r"├─Embedding \(emb\): 1-2 .*  40   57\.14%$", text, flags=re.M)
    assert re.search(r"├─Linear \(head\): 1-4 .*  \(recursive\)       --$", text, flags=re.M)
    assert "Total params: 70" in text
    # each share is rounded to 0.005 %: the shares add up to 100 % within that per row
    percents = shown_percents(text)
    assert len(percents) == 3 and abs(sum(percents) - 100) <= 0.005 * len(percents)


def test_a_tied_gpt2_head_is_counted_once_on_the_token_embedding() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=50, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    net = transformers.GPT2LMHeadModel(config)
    assert net.lm_head.weight is net.transformer.wte.weight
    total = sum(p.numel() for p in net.parameters())
    inspector = Inspector(net, input_size=(1, 5), dtypes=[torch.long])
    rows = {row.name: row for row in inspector.layers}
    assert (rows["transformer.wte"].params, rows["transformer.wte"].shared) == (400, ())
    assert (rows["lm_head"].params, rows["lm_head"].shared) == (0, ("transformer.wte.weight",))
    assert sum(row.params for row in inspector.layers) == total
    text = inspector.summary_text()
    assert re.search(
        r"├─Linear \(lm_head\): 1-2 .* \(shared: transformer\.wte\.weight\)       --$",
        text,
        flags=re.M,
    )
    assert f"Total params: {total:,}" in text
    percents = shown_percents(text)
    assert abs(sum(percents) - 100) <= 0.005 * len(percents)  # each share rounded to 0.005 %


class HalfUsed(nn.Module):
    """`spare` and `unused` (a container whose children hold the parameters) are never called;
    `head.weight` is also held by `tied`, which is never called either."""

    def __init__(self, spares: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 4)
        for i in range(spares):
            self.add_module("spare" if i == 0 else f"spare{i}", nn.Linear(2, 2))
        self.unused = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        self.tied = nn.Linear(4, 2, bias=False)
        self.head = nn.Linear(4, 2)
        self.tied.weight = self.head.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_parameters_of_modules_not_called_are_counted_in_a_footer_line() -> None:
    net = HalfUsed()
    total = sum(p.numel() for p in net.parameters())  # 20 + 6 + 25 + 10, the tied weight once
    inspector = Inspector(net, input_size=(1, 4))
    assert sum(row.params for row in inspector.layers) == 30  # body and head: 51 % in no row
    text = inspector.summary_text()
    lines = text.splitlines()
    at = lines.index("Non-trainable params: 0")
    # the tied weight counts on head's row; spare's and unused's children's in no row
    assert lines[at + 1] == "Params of modules not called: 31 (50.82%): spare, unused"
    assert lines[at - 2 : at] == [f"Total params: {total}", "Trainable params: 61"]
    assert lines[at + 2].startswith("====")
    # each share is rounded to 0.005 %: the rows and the line add up to 100 % within that each
    percents = shown_percents(text)
    assert len(percents) == 3 and abs(sum(percents) - 100) <= 0.005 * len(percents)
    assert re.search(r"├─Linear \(head\): 1-2 .*  10   16\.39%$", text, flags=re.M)
    # up to three modules are named, then "…"
    text = Inspector(HalfUsed(spares=3), input_size=(1, 4)).summary_text()
    assert "Params of modules not called: 43 (58.90%): spare, spare1, spare2, …" in text
    # no line when every parameter is counted on a row (tied, scripted: see their tests)
    assert "not called:" not in Inspector(toynet(), input_size=(1, 5)).summary_text()
    tied = Inspector(TiedHeadFirst(), input_size=(2, 3), dtypes=[torch.long])
    assert "not called:" not in tied.summary_text()


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
def test_summary_of_nested_inputs_shows_ragged_dimensions_as_minus_one(
    layout: torch.layout,
) -> None:
    x = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=layout)
    text = Inspector(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), input_data=x).summary_text()
    assert re.search(r"├─Linear \(0\): 1-1 +\[2, -1, 4\] +\[2, -1, 4\] +20", text), text


# --- labels -----------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [toynet, Blocks, Shared, Interleaved])
def test_labels_of_called_layers_match_torchinfo(make: type[nn.Module]) -> None:
    torchinfo = pytest.importorskip("torchinfo")
    net = make()
    size = (1, 5) if isinstance(net, nn.Sequential) else (1, 4)
    info = torchinfo.summary(net, input_size=size, verbose=0).summary_list
    theirs = [(i.depth, i.depth_index, i.class_name) for i in info if i.executed]
    layers = Inspector(net, input_size=size).layers
    assert [(*r.label, r.type_name) for r in layers if r.called] == theirs
    if make is not Interleaved:  # torchinfo repeats a container's last label there
        assert [(*r.label, r.type_name) for r in layers] == [
            (i.depth, i.depth_index, i.class_name) for i in info
        ]


def test_never_called_containers_get_rows_but_cannot_be_recorded() -> None:
    rnet = Inspector(Interleaved(), input_size=(1, 4))
    rows = [(r.text, r.name, r.called) for r in rnet.layers if r.label[0] == 1]
    assert rows == [
        ("1-1", "a", False),
        ("1-2", "b", False),
        ("1-3", "a", False),
        ("1-4", "deep", True),
        ("1-5", "b", False),
    ]
    with pytest.raises(
        RecorderConfigError, match=r"1-2 \(ModuleDict 'b'\) is a container that is never called"
    ):
        rnet.record("1-2")
    assert rnet.recording == () and live_hooks() == []


def test_a_module_called_twice_gets_one_label_per_call() -> None:
    net = Shared()
    rnet = Inspector(net, input_size=(1, 4))
    fc_rows = [(r.text, r.call) for r in rnet.layers if r.name == "fc"]
    assert fc_rows == [("1-1", 0), ("1-3", 1)]
    rnet.record("1-3", "1-4")
    x = torch.randn(2, 4)
    rnet(x)
    first = torch.tanh(net.fc(x))
    second = net.fc(first)
    torch.testing.assert_close(rnet.activations["1-3"], second)
    torch.testing.assert_close(rnet.activations["1-4"], torch.tanh(second))
    assert list(rnet.recorded_modules.values()) == [net.fc, net.act]
    assert list(rnet.recorded_params) == ["fc.weight", "fc.bias"]
    rnet.release()


class CountedWalks(tuple[LayerRow, ...]):
    """The rows of a summary, counting the walks over them."""

    walks = 0

    def __iter__(self) -> Iterator[LayerRow]:
        CountedWalks.walks += 1
        return super().__iter__()


def test_recording_every_layer_does_not_walk_the_summary_once_per_layer() -> None:
    """record() found each chosen module's calls by walking every row of the summary, a time
    quadratic in the layers when a deep network is recorded whole (1.3 s for 8,000 layers);
    the calls of each module are now known from the traced forward."""
    net = nn.Sequential(Shared(), *[nn.Linear(2, 2) for _ in range(40)])
    with Inspector(net, input_size=(1, 4)) as rnet:
        rnet._layers = CountedWalks(rnet._layers)
        CountedWalks.walks = 0
        rnet.record(*[row.label for row in rnet.layers if row.called])
        assert CountedWalks.walks <= 2  # was once per recorded module (46)
        x = torch.randn(2, 4)
        rnet(x)
        first = net[0].fc(x)
        second = net[0].fc(torch.tanh(first))  # the shared layer's two calls, each its own label
        torch.testing.assert_close(rnet.activations["2-1"], first)
        torch.testing.assert_close(rnet.activations["2-3"], second)
        assert len(rnet.activations) == len([row for row in rnet.layers if row.called])


def test_labels_are_parsed_from_tuples_lists_and_strings() -> None:
    with Inspector(toynet(), input_size=(1, 5)) as rnet:
        rnet.record([1, 3], " 1-1 ", (1, 3), "0-1")
        assert rnet.recording == ((0, 1), (1, 1), (1, 3))  # call order, duplicates dropped
        rnet.record()
        assert rnet.recording == () and live_hooks() == []


def test_label_errors() -> None:
    with Inspector(toynet(), input_size=(1, 5)) as rnet:
        with pytest.raises(
            UnknownSourceError, match=r"No layer labelled 1-9 .*Closest layer labels:"
        ):
            rnet.record((1, 9))
        with pytest.raises(UnknownSourceError, match=r"No layer labelled 3-1 in Sequential"):
            rnet.record("3-1")
        for bad in ("1.3", (1,), (1, True), 13, (1, -3)):
            with pytest.raises(RecorderConfigError, match=r"Expected a layer label such as"):
                rnet.record(bad)  # type: ignore[arg-type]
        rnet.record("1-1")
        with pytest.raises(UnknownSourceError):
            rnet.record("1-1", "9-9")
        assert rnet.recording == ((1, 1),)  # a failed call changes nothing
        assert len(live_hooks()) == 2
        with pytest.raises(KeyError, match=r"No entry for layer 1-2; entries: none"):
            rnet.activations["1-2"]


def test_activations_answer_in_and_get_for_any_key_as_a_mapping() -> None:
    """``in`` and ``get`` answer ``False`` and the default for a key that is no label (as any
    Mapping does); only ``[...]`` with one raises the clear error."""
    with Inspector(toynet(), input_size=(1, 5)) as rnet:
        rnet.record("1-1")
        rnet(torch.randn(2, 5))
        held = rnet.activations
        assert (1, 1) in held and "1-1" in held and [1, 1] in held
        assert "1-2" not in held and (1, 3) not in held
        for key in ("x", "1.3", "0", (1,), (1, True), 13, None, (1, 2, 3)):
            assert key not in held
            assert held.get(key) is None and held.get(key, "none") == "none"
        assert held.get("1-1") is held[(1, 1)] and held.get("1-2", 0) == 0
        assert list(held.keys()) == [(1, 1)] and dict(held.items()) == {(1, 1): held["1-1"]}
        with pytest.raises(RecorderConfigError, match=r"Expected a layer label such as"):
            held["x"]


# --- forward: recording, post-processing, dont_record -----------------------------------------


def test_one_postprocessor_for_every_recorded_layer_replaces_outputs() -> None:
    net = toynet()
    x = torch.rand(3, 5)
    with Inspector(net, input_size=(1, 5)) as rnet:
        rnet.record("1-1", "1-3")
        out = rnet(x, activation_postproc=lambda t: t * 0 + 1)
        ones = torch.ones(3, 3)
        torch.testing.assert_close(out, torch.relu(ones))
        torch.testing.assert_close(rnet.activations["1-1"], net[0](x))  # recorded before
        torch.testing.assert_close(rnet.activations["1-3"], net[2](torch.ones(3, 4)))


def test_a_list_of_postprocessors_follows_call_order_and_none_keeps() -> None:
    net = toynet()
    x = torch.rand(2, 5)
    seen: list[tuple[int, ...]] = []
    with Inspector(net, input_size=(1, 5)) as rnet:
        rnet.record("1-3", "1-1")

        def watch(t: torch.Tensor) -> None:
            seen.append(tuple(t.shape))

        out = rnet(x, activation_postproc=[lambda t: -t, watch])
    assert seen == [(2, 3)]  # the second postprocessor belongs to 1-3, called second
    torch.testing.assert_close(out, torch.relu(net[2](torch.relu(-net[0](x)))))


def test_in_place_postprocessing_changes_the_record() -> None:
    net = toynet()
    with Inspector(net, input_size=(1, 5)) as rnet:
        rnet.record("1-1")
        rnet(torch.rand(1, 5), activation_postproc=lambda t: t.zero_())
        assert torch.count_nonzero(rnet.activations["1-1"]) == 0


def test_a_record_changed_in_place_later_in_the_forward_is_refused_not_returned() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 4), nn.ReLU(inplace=True), nn.Linear(4, 3))
    x = torch.randn(8, 5)
    with Inspector(net, input_size=(1, 5)) as rnet:
        rnet.record("1-1", "1-3")  # the ReLU changes the output of 1-1 in place
        rnet(x)
        assert rnet.activations["1-3"].shape == (8, 3)  # untouched records stay readable
        with pytest.raises(RecordModifiedError, match=r"layer 1-1 was modified in place"):
            rnet.activations["1-1"]
        # the way out the message gives: the rest of the forward uses a copy
        rnet(x, activation_postproc=torch.clone)
        expected = net[0](x).detach()
        # one float32 linear layer computed twice: equal to rounding
        torch.testing.assert_close(rnet.activations["1-1"], expected, rtol=1e-6, atol=1e-6)
        assert bool((rnet.activations["1-1"] < 0).any())  # not the ReLU's output


def test_postprocessor_errors() -> None:
    with Inspector(toynet(), input_size=(1, 5)) as rnet:
        rnet.record("1-1", "1-3")
        with pytest.raises(
            RecorderConfigError,
            match=r"list of 2 callables, one per recorded layer \(1-1, 1-3\), but got",
        ):
            rnet(torch.rand(1, 5), activation_postproc=[torch.relu])
        with pytest.raises(RecorderConfigError, match=r"Expected `activation_postproc`"):
            rnet(torch.rand(1, 5), activation_postproc="relu")  # type: ignore[arg-type]


def test_dont_record_keeps_previous_activations_and_still_postprocesses() -> None:
    net = toynet()
    with Inspector(net, input_size=(1, 5)) as rnet:
        rnet.record("0-1")
        x = torch.rand(1, 5)
        rnet(x)
        kept = rnet.activations["0-1"]
        out = rnet(torch.rand(1, 5), dont_record=True, activation_postproc=lambda t: t + 100)
        assert rnet.activations["0-1"] is kept
        assert bool((out >= 100).all())


def test_missing_recorded_layer_raises_and_names_it() -> None:
    net = Branchy()
    torch.manual_seed(0)
    with torch.no_grad():
        net.fc.bias.fill_(5.0)  # traced forward takes the branch
    with Inspector(net, input_size=(1, 3)) as rnet:
        rnet.record("1-1", "1-2")
        rnet(torch.rand(1, 3))
        with torch.no_grad():
            net.fc.bias.fill_(-50.0)
        with pytest.raises(
            RecorderStateError,
            match=r"1 did not: 1-2 is call 1 of Linear 'extra', which ran 0 time\(s\) in this "
            r"forward\. Recorded layers that ran: 1-1\.",
        ):
            rnet(torch.rand(1, 3))
        assert list(rnet.activations) == [(1, 1)]  # what that forward did record
        rnet(torch.rand(1, 3), dont_record=True)  # nothing asked of that forward: no error


def test_a_recorded_module_replaced_in_the_network_is_named_as_replaced() -> None:
    net = toynet()
    x = torch.rand(2, 5)
    with Inspector(net, input_size=(1, 5)) as rnet:
        rnet.record("1-1", "1-3")
        rnet(x)
        net[0] = nn.Linear(5, 4)  # the same place, another module: its forward is not hooked
        with pytest.raises(RecorderStateError, match=r"1 did not: the module of 1-1") as info:
            rnet(x)
        assert "call record() again" in str(info.value)
        assert "control flow" not in str(info.value)
        rnet.record("1-1", "1-3")  # what the message says: the new module is recorded
        rnet(x)
        # the same float32 linear layer on the same input: equal to rounding
        torch.testing.assert_close(rnet.activations["1-1"], net[0](x), rtol=1e-6, atol=1e-6)


def test_only_forwards_through_the_inspector_record() -> None:
    net = toynet()
    with Inspector(net, input_size=(1, 5)) as rnet:
        rnet.record("1-1")
        net(torch.rand(1, 5))
        assert len(rnet.activations) == 0


def test_detach_option_and_gradients_through_activations() -> None:
    net = toynet()
    with Inspector(net, input_size=(1, 5)) as rnet:
        rnet.record("1-1")
        rnet(torch.rand(2, 5))
        rnet.activations["1-1"].pow(2).sum().backward()
        assert net[0].weight.grad is not None
    with Inspector(net, input_size=(1, 5), detach=True) as detached:
        detached.record("1-1")
        detached(torch.rand(2, 5))
        assert detached.activations["1-1"].grad_fn is None


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.fc(out[:, -1])


def test_detach_option_detaches_every_tensor_of_a_structured_output() -> None:
    net = _Recurrent()
    with Inspector(net, input_size=(2, 5, 3), detach=True) as rnet:
        rnet.record("1-1")  # the LSTM: (output, (h, c))
        x = torch.randn(2, 5, 3)
        rnet(x)
        out, (h, c) = rnet.activations["1-1"]
        assert [t.requires_grad for t in (out, h, c)] == [False, False, False]
        expected, _ = net.lstm(x)
        # the same LSTM kernel on the same input, run twice: equal to float32 rounding
        torch.testing.assert_close(out, expected.detach(), rtol=1e-6, atol=1e-6)


def test_activations_and_recorded_modules_are_read_only() -> None:
    with Inspector(toynet(), input_size=(1, 5)) as rnet:
        rnet.record("1-1")
        rnet(torch.rand(1, 5))
        with pytest.raises(TypeError):
            rnet.activations[(1, 1)] = torch.zeros(1)  # type: ignore[index]
        with pytest.raises(TypeError):
            rnet.recorded_modules[(1, 1)] = nn.ReLU()  # type: ignore[index]


def test_recording_skips_activation_checkpoint_recomputation() -> None:
    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(3, 3), nn.Tanh())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.block, x, use_reentrant=False)

    net = Checkpointed()
    with Inspector(net, input_size=(1, 3)) as rnet:
        rnet.record("2-1")
        x = torch.rand(2, 3, requires_grad=True)
        rnet(x).sum().backward()
        torch.testing.assert_close(rnet.activations["2-1"], net.block[0](x))
        assert x.grad is not None


# --- construction -----------------------------------------------------------------------------


def test_input_data_as_tensor_tuple_or_keywords_and_integer_dtypes() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.fc = nn.Linear(4, 2)

        def forward(self, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return self.fc(self.emb(ids)) * scale

    net = Two()
    ids = torch.tensor([[1, 2, 3]])
    by_tensor = Inspector(net, input_data=ids).layers
    assert by_tensor[1].input_shapes == ((1, 3),) and by_tensor[2].output_shapes == ((1, 3, 2),)
    assert Inspector(net, input_data=(ids, 2.0)).layers == by_tensor
    assert Inspector(net, input_data={"ids": ids}).layers == by_tensor
    assert Inspector(net, input_size=(1, 3), dtypes=[torch.long]).layers == by_tensor


def test_construction_errors() -> None:
    net = toynet()
    with pytest.raises(RecorderConfigError, match=r"exactly one of `input_size`.*but got neither"):
        Inspector(net)
    with pytest.raises(RecorderConfigError, match=r"but got both"):
        Inspector(net, input_size=(1, 5), input_data=torch.rand(1, 5))
    with pytest.raises(RecorderConfigError, match=r"Expected `input_size` to be a shape such as"):
        Inspector(net, input_size="1, 5")  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"Expected `dtypes` to be 1 torch.dtype"):
        Inspector(net, input_size=(1, 5), dtypes=[torch.float32, torch.long])
    with pytest.raises(RecorderConfigError, match=r"Expected `input_data` to be a tensor"):
        Inspector(net, input_data=3)
    with pytest.raises(RecorderConfigError, match=r"Expected `net` to be an nn.Module but got"):
        Inspector("net")  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"Expected `mode` to be one of"):
        Inspector(net, input_size=(1, 5), mode="test")  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"Expected `detach` to be a bool"):
        Inspector(net, input_size=(1, 5), detach=1)  # type: ignore[arg-type]
    net.train()
    with pytest.raises(RecorderConfigError, match=r"the traced forward raised RuntimeError"):
        Inspector(net, input_size=(1, 7))
    assert live_hooks() == [] and net.training
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.modules())


def test_traced_forward_leaves_modes_buffers_and_random_state_as_found() -> None:
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Dropout(0.5))
    net.train()
    net[2].eval()  # mixed modes survive
    stats = net[1].running_mean.clone(), net[1].num_batches_tracked.clone()
    for mode in ("eval", "train", "same"):
        torch.manual_seed(123)
        Inspector(net, input_size=(4, 3), mode=mode)  # type: ignore[arg-type]
        after = torch.rand(3)
        torch.manual_seed(123)
        assert torch.equal(after, torch.rand(3))
        assert [m.training for m in net.modules()] == [True, True, True, False]
        assert torch.equal(net[1].running_mean, stats[0])
        assert torch.equal(net[1].num_batches_tracked, stats[1])


class Counting(nn.Module):
    """Replaces its buffers in the forward instead of changing them in place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("cache", torch.zeros(1, 3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        if self.cache.shape[0] < x.shape[0]:
            self.cache = torch.ones(x.shape[0], 3)
        return self.fc(x) + self.cache[: x.shape[0]]


def test_traced_forward_and_summary_restore_buffers_the_forward_replaced() -> None:
    net = Counting()
    calls, cache = net.calls, net.cache
    inspector = Inspector(net, input_size=(4, 3))
    assert net.calls is calls and net.cache is cache
    assert int(net.calls) == 0 and net.cache.shape == (1, 3)
    if importlib.util.find_spec("torchinfo") is not None:
        inspector.summary  # noqa: B018 - one more forward
        assert net.calls is calls and int(net.calls) == 0 and net.cache.shape == (1, 3)


def test_traced_forward_of_lazy_modules_leaves_their_new_buffers_as_initialized() -> None:
    norm = nn.LazyBatchNorm2d()
    net = nn.Sequential(nn.LazyConv2d(4, 3), norm, norm)  # called twice
    inspector = Inspector(net, input_size=(2, 3, 8, 8), mode="train")
    assert [row.params for row in inspector.layers] == [0, 112, 8, 0]
    assert torch.equal(net[1].running_mean, torch.zeros(4))
    assert torch.equal(net[1].running_var, torch.ones(4))
    assert int(net[1].num_batches_tracked) == 0
    assert not live_hooks()


def test_a_scripted_submodule_gets_no_row_and_a_scripted_network_is_refused() -> None:
    torch.manual_seed(0)
    block = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    net = nn.Sequential(nn.Linear(4, 4), block, nn.Linear(4, 2))
    inspector = Inspector(net, input_size=(1, 4))  # torch allows a scripted module no hooks
    assert [(row.text, row.name) for row in inspector.layers] == [
        ("0-1", ""),
        ("1-1", "0"),
        ("1-2", "2"),
    ]
    assert "Total params: 50" in inspector.summary_text()
    assert "not called:" not in inspector.summary_text()  # whether it ran is not known
    inspector.record("1-2")
    x = torch.randn(3, 4)
    inspector(x)
    torch.testing.assert_close(inspector.activations["1-2"], net(x), rtol=0, atol=0)
    inspector.release()
    assert not live_hooks()
    with pytest.raises(RecorderConfigError, match=r"scripted module.*before scripting it"):
        Inspector(block, input_size=(1, 4))


# --- cleanup, module behaviour, copies ----------------------------------------------------------


def test_release_context_and_gc_remove_every_hook() -> None:
    net = Shared()
    rnet = Inspector(net, input_size=(1, 4))
    rnet.record("1-1", "1-3", "1-5")
    assert len(live_hooks()) == 4  # fc (one module, two labels) and out: a pre-hook and a hook
    rnet.release()
    rnet.release()
    assert live_hooks() == [] and rnet.recording == ()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.modules())
    rnet.record("0-1")
    del rnet
    gc.collect()
    assert live_hooks() == []
    with Inspector(net, input_size=(1, 4)) as rnet2:
        rnet2.record("1-2")
    assert live_hooks() == []


def test_the_inspector_is_a_module_around_its_network() -> None:
    net = toynet()
    with Inspector(net, input_size=(1, 5)) as rnet:
        assert rnet.net is net
        assert [p for p in rnet.parameters()] == list(net.parameters())
        assert set(rnet.state_dict()) == {f"net.{k}" for k in net.state_dict()}
        rnet.eval()
        assert not net.training and not net[0].training
        rnet.train()
        assert net.training


def test_deepcopy_and_pickle_keep_recording_and_leave_the_original_alone() -> None:
    net = toynet()
    x = torch.rand(1, 5)
    with Inspector(net, input_size=(1, 5)) as rnet:
        rnet.record("1-3")
        for twin in (copy.deepcopy(rnet), pickle.loads(pickle.dumps(rnet))):
            assert twin.recording == ((1, 3),) and twin.net is not net
            twin(x)
            torch.testing.assert_close(twin.activations["1-3"], net[2](net[1](net[0](x))))
            assert len(rnet.activations) == 0  # the original recorded nothing
            twin.release()
        plain = copy.deepcopy(net)  # the wrapped network alone copies too; its hooks are inert
        torch.testing.assert_close(plain(x), net(x))
        pickle.loads(pickle.dumps(net))


def test_deepcopy_after_a_forward_that_recorded_activations_with_their_graph() -> None:
    """With ``detach=False`` (the default) the recorded activations are part of the autograd
    graph; a copy gets them without it, equal in value, and records on its own."""
    net = toynet()
    x = torch.rand(2, 5)
    with Inspector(net, input_size=(1, 5)) as rnet:
        rnet.record("1-3")
        rnet(x)
        assert rnet.activations["1-3"].grad_fn is not None
        for twin in (copy.deepcopy(rnet), pickle.loads(pickle.dumps(rnet))):
            kept = twin.activations["1-3"]
            assert kept.grad_fn is None
            torch.testing.assert_close(kept, rnet.activations["1-3"].detach())
            twin(2 * x)  # records its own forward; the original's activations stay
            layers = twin.net
            expected = layers[2](layers[1](layers[0](2 * x)))
            torch.testing.assert_close(twin.activations["1-3"].detach(), expected)
            assert rnet.activations["1-3"].grad_fn is not None
            twin.release()


# --- documentation ----------------------------------------------------------------------------


def test_docstring_examples() -> None:
    result = doctest_room(inspector_module)
    assert result.attempted >= 7 and result.failed == 0


def test_docs_page_examples_run() -> None:
    assert len(python_blocks(DOCS / "inspector.md")) >= 3
    run_page(DOCS / "inspector.md")
    text = (DOCS / "inspector.md").read_text(encoding="utf-8")
    shown = re.findall(r"```text\n(.*?)```", text, flags=re.S)[0]
    assert shown.rstrip("\n") == repr(Inspector(toynet(), input_size=(1, 5)))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def test_torchinfo_table_options_choose_columns_and_depth() -> None:
    text = Inspector(
        Nested(), input_size=(1, 2), col_names=("output_size",), depth=1
    ).summary_text()
    assert "Output Shape" in text and "Input Shape" not in text and "Param %" not in text
    assert "Sequential (block): 1-1" in text and "Linear (head): 1-2" in text
    assert "2-1" not in text  # deeper than depth=1
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'col_name'.*'col_names'"):
        Inspector(Nested(), input_size=(1, 2), col_name=("output_size",))
    with pytest.raises(RecorderConfigError, match=r"`col_names`.*'kernel_size'"):
        Inspector(Nested(), input_size=(1, 2), col_names=("kernel_size",))
    with pytest.raises(RecorderConfigError, match=r"`depth` to be a non-negative int"):
        Inspector(Nested(), input_size=(1, 2), depth=-1)


def test_summary_is_torchinfo_statistics_with_the_options() -> None:
    torchinfo = pytest.importorskip("torchinfo")
    inspector = Inspector(Nested(), input_size=(4, 2), depth=1, verbose=0)
    state = torch.random.get_rng_state()
    statistics = inspector.summary
    assert isinstance(statistics, torchinfo.ModelStatistics)
    assert statistics is inspector.summary  # computed once
    # torchinfo lists every layer; depth=1 limits only its printed table.
    rows = [(r.depth, r.depth_index) for r in statistics.summary_list]
    assert rows == [(0, 1), (1, 1), (2, 1), (2, 2), (1, 2)]
    assert "Linear: 2-1" not in str(statistics) and "Linear (head): 1-2" in str(statistics)
    assert statistics.total_params == sum(p.numel() for p in inspector.net.parameters())
    assert torch.equal(torch.random.get_rng_state(), state)
    assert not live_hooks()


def test_reading_summary_leaves_modes_and_buffers_as_found() -> None:
    pytest.importorskip("torchinfo")
    for mode in ("eval", "train"):
        net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.BatchNorm1d(3), nn.Dropout(0.5))
        net.train()
        net[2].eval()  # a frozen normalization layer in a training network
        stats = net[1].running_mean.clone(), net[1].num_batches_tracked.clone()
        inspector = Inspector(net, input_size=(4, 3), mode=mode)  # type: ignore[arg-type]
        assert inspector.summary.total_params == sum(p.numel() for p in net.parameters())
        assert [m.training for m in net.modules()] == [True, True, True, False, True]
        assert torch.equal(net[1].running_mean, stats[0])
        assert torch.equal(net[1].num_batches_tracked, stats[1])


class ModeProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.drop = nn.Dropout(0.5)
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.fc.training, self.drop.training))
        return self.drop(self.fc(x))


def test_summary_with_mode_same_runs_the_network_in_its_own_modes() -> None:
    pytest.importorskip("torchinfo")
    net = ModeProbe()
    net.train()
    net.drop.eval()
    inspector = Inspector(net, input_size=(4, 3), mode="same")
    assert inspector.summary.total_params == 12
    assert net.seen == [(True, False), (True, False)]  # the traced forward, then torchinfo's
    assert [m.training for m in net.modules()] == [True, True, False]
    assert not live_hooks()


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) if x.sum() > 0 else x


def test_force_static_flow_refuses_data_dependent_control_flow() -> None:
    with pytest.raises(RecorderStateError, match=r"control flow.*`force_static_flow=False`"):
        Inspector(DataDependent(), input_size=(1, 2), force_static_flow=True)
    Inspector(DataDependent(), input_size=(1, 2)).release()  # the default accepts it
    with pytest.raises(RecorderConfigError, match=r"`force_static_flow` to be a bool"):
        Inspector(Nested(), input_size=(1, 2), force_static_flow="yes")  # type: ignore[arg-type]


def test_list_postprocessors_go_to_layers_as_they_finish_and_see_current_activations() -> None:
    inspector = Inspector(Nested(), input_size=(1, 2))
    inspector.record((0, 1), (2, 1), (1, 2))
    assert inspector.recording == ((0, 1), (1, 2), (2, 1))  # sorted
    seen: list[tuple[int, set[tuple[int, int]]]] = []

    def spy(i: int) -> Callable[[torch.Tensor], None]:
        def post(out: torch.Tensor) -> None:
            seen.append((i, set(inspector.activations)))

        return post

    inspector(torch.randn(3, 2), activation_postproc=[spy(0), spy(1), spy(2)])
    # 2-1 (block.0) finishes first, then 1-2 (head), then the network 0-1.
    assert seen == [(0, {(2, 1)}), (1, {(2, 1), (1, 2)}), (2, {(2, 1), (1, 2), (0, 1)})]
    with pytest.raises(RecorderConfigError, match=r"`dont_record` to be a bool"):
        inspector(torch.randn(3, 2), dont_record="yes")
    with pytest.raises(RecorderConfigError, match=re.escape("`rnet.record((1, 2))`")):
        inspector.record(1, 2)
    inspector.release()


def test_device_dtypes_and_input_size_errors() -> None:
    with pytest.raises(RecorderConfigError, match=r"`input_size`.*positive sizes.*\(0, 2\)"):
        Inspector(Nested(), input_size=(0, 2))
    with pytest.raises(RecorderConfigError, match=r"`dtypes` to be 1 torch.dtype.*int 5"):
        Inspector(Nested(), input_size=(1, 2), dtypes=5)  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"`device`.*device string.*'gpu'"):
        Inspector(Nested(), input_size=(1, 2), device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(RecorderConfigError, match=r"`device`.*'cuda:0'.*not available"):
            Inspector(Nested(), input_size=(1, 2), device="cuda:0")


def test_dtypes_or_device_with_input_data_is_refused_not_ignored() -> None:
    """``input_data`` is traced as given: a ``dtypes`` or ``device`` beside it would do nothing."""
    x = torch.ones(1, 2)
    with pytest.raises(RecorderConfigError, match=r"`dtypes` only with `input_size`.*to\(dtype"):
        Inspector(Nested(), input_data=x, dtypes=[torch.float64])
    with pytest.raises(RecorderConfigError, match=r"`device` only with `input_size`.*to\(device"):
        Inspector(Nested(), input_data=x, device="cpu")
    net = Nested()
    with pytest.raises(RecorderConfigError):
        Inspector(net, input_data=(x,), dtypes=[torch.float32])
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.modules())
