"""The package's hooks never displace a hook already registered (hook ids restart per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_recorder import RecorderManager
from lightning_recorder._core.hooks import HookSet, register

ROOT = Path(__file__).resolve().parents[2]


def child_env() -> dict[str, str]:
    paths = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def test_install_does_not_replace_a_hook_sitting_at_the_next_id() -> None:
    model = nn.Linear(2, 2)
    seen: list[str] = []
    # What an unpickled model looks like in a fresh process: a hook under the id the counter
    # will hand out next.
    user_id = RemovableHandle.next_id
    model._forward_hooks[user_id] = lambda m, a, o: seen.append("user")
    with HookSet("test") as hooks:
        handle = hooks.install(partial(model.register_forward_hook, lambda m, a, o: None))
        assert handle.id != user_id
        model(torch.ones(1, 2))
        assert seen == ["user"]
        hooks.suspend()
        hooks.resume()  # reinstalling goes through the same check
        model(torch.ones(1, 2))
    assert seen == ["user", "user"] and list(model._forward_hooks) == [user_id]


def test_plain_registration_would_replace_it() -> None:
    # The control: without the package's check, torch's own registration displaces the hook.
    model = nn.Linear(2, 2)
    model._forward_hooks[RemovableHandle.next_id] = "user"
    handle = model.register_forward_hook(lambda m, a, o: None)
    assert model._forward_hooks[handle.id] != "user"
    handle.remove()


def test_add_with_a_maker_and_tensor_hooks() -> None:
    param = nn.Parameter(torch.ones(3))
    user_id = RemovableHandle.next_id
    param.register_hook(lambda g: g)  # creates the dict; takes user_id
    assert list(param._backward_hooks) == [user_id]
    param._backward_hooks[RemovableHandle.next_id] = "user"
    handle = register(partial(param.register_hook, lambda g: g))
    try:
        assert "user" in param._backward_hooks.values()
    finally:
        handle.remove()
    with HookSet("test") as hooks:
        model = nn.Linear(2, 2)
        model._forward_pre_hooks[RemovableHandle.next_id] = "user"
        hooks.add(partial(model.register_forward_pre_hook, lambda m, a: None))
        assert list(model._forward_pre_hooks.values()).count("user") == 1


CHILD = textwrap.dedent(
    """
    import json, pickle, sys
    import torch
    from torch import nn

    def user_hook(module, args, output):
        module.user_calls = getattr(module, "user_calls", 0) + 1

    if sys.argv[1] == "dump":
        model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        for _ in range(4):  # ids 0 to 3 in this fresh process
            model[0].register_forward_hook(user_hook)
        sys.stdout.buffer.write(pickle.dumps(model))
    else:
        from lightning_recorder import RecorderManager
        model = pickle.loads(sys.stdin.buffer.read())
        ids = list(model[0]._forward_hooks)
        first_free = torch.utils.hooks.RemovableHandle.next_id
        if sys.argv[1] == "plain":
            model[0].register_forward_hook(lambda m, a, o: None)
        else:
            manager = RecorderManager({"out": {"type": "ModuleOutputs", "source": "0"}})
            manager.initialize(model)
            with manager:
                model(torch.ones(1, 2))
            assert manager.get_recorder("out").get_record_data().shape == (1, 2)
            manager.release()
        model[0].user_calls = 0
        model(torch.ones(1, 2))
        print(json.dumps({"ids": ids, "first_free": first_free,
                          "user_calls": getattr(model[0], "user_calls", 0)}))
    """
)


def run_child(script: Path, mode: str, data: bytes | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(script), mode],
        input=data,
        capture_output=True,
        env=child_env(),
        timeout=300,  # a fresh interpreter importing torch on a loaded machine
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return proc


def test_a_model_unpickled_in_a_new_process_keeps_its_hooks(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    pickled = run_child(script, "dump").stdout
    plain = json.loads(run_child(script, "plain", pickled).stdout)
    # the scenario is real: a fresh process's counter starts below the unpickled hooks' ids,
    # and torch's own registration replaces one of them
    assert plain["first_free"] in plain["ids"]
    assert plain["user_calls"] == len(plain["ids"]) - 1
    recorded = json.loads(run_child(script, "package", pickled).stdout)
    assert recorded["user_calls"] == len(recorded["ids"]) == 4  # every user hook still fires


SPAWN = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from helpers.dist_exit import DestroyProcessGroup
    from lightning_recorder import RecorderCallback

    HOOKS = 100

    class UserHook:
        def __init__(self, out):
            self.out = out
        def __call__(self, module, args, output):
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else -1
            with open(Path(self.out) / f"user{rank}.txt", "a") as f:
                f.write("x")

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        def training_step(self, batch, batch_idx):
            return self.body(batch[0]).square().mean()
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    if __name__ == "__main__":
        out = sys.argv[1]
        model = Net()
        # enough hooks that their ids cover those a spawned process hands out before the
        # callback registers its own (the counter restarts at 0 there)
        hook = UserHook(out)
        for _ in range(HOOKS):
            model.body[0].register_forward_hook(hook)
        callback = RecorderCallback({"b": {"type": "ModuleOutputs", "source": "body.0"}})
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)))
        trainer = pl.Trainer(strategy="ddp_spawn", devices=2, accelerator="cpu", max_steps=2,
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[callback, DestroyProcessGroup(out)])
        trainer.fit(model, data)
    """
)


@pytest.mark.slow
def test_user_hooks_survive_ddp_spawn(tmp_path: Path) -> None:
    from helpers.dist_exit import assert_no_c10d_threads_left  # imports Lightning

    script = tmp_path / "spawn.py"
    script.write_text(SPAWN)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        env=child_env(),
        cwd=tmp_path,
        timeout=240,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # every user hook, two steps, on each of the two ranks
    counts = {rank: len((tmp_path / f"user{rank}.txt").read_text()) for rank in (0, 1)}
    assert counts == {0: 200, 1: 200}
    # Both workers exited with no thread of the process group left (see helpers.dist_exit: a
    # gloo thread still running as the interpreter finalizes can abort the worker).
    assert_no_c10d_threads_left(tmp_path)


def test_manager_in_process_keeps_a_hook_at_the_next_id() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    seen: list[int] = []
    model[0]._forward_hooks[RemovableHandle.next_id] = lambda m, a, o: seen.append(1)
    manager = RecorderManager({"out": {"type": "ModuleOutputs", "source": "0"}})
    manager.initialize(model)
    try:
        with manager:
            model(torch.ones(1, 2))
    finally:
        manager.release()
    assert seen == [1]
