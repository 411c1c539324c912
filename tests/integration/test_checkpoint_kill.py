"""A trainer killed (SIGKILL) while it writes a checkpoint leaves the previous one whole and usable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlfleet.workers.trainer.checkpoint import TMP_PREFIX, latest_checkpoint, read_checkpoint

pytestmark = pytest.mark.integration
# A model big enough (~45 MB, with optimizer state ~130 MB a checkpoint) that a write takes a while.
WRITER = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from rlfleet.workers.trainer.checkpoint import save_checkpoint
root, step = sys.argv[1], int(sys.argv[2])
model = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False))
optimizer = torch.optim.AdamW(model.parameters())
model(torch.tensor([[1, 2]])).logits.mean().backward()
optimizer.step()
while True:
    with torch.no_grad():  # every weight of checkpoint N is N: a mix of two writes shows
        for parameter in model.parameters():
            parameter.fill_(step)
    save_checkpoint(root, step, model, model.state_dict(), optimizer.state_dict(), {"data_position": 10 * step}, keep=2)
    step += 1
"""


def _writer(root: Path, step: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(step)], cwd=root.parent,
                            stderr=subprocess.PIPE)


def _writing(root: Path) -> bool:
    return any(entry.name.startswith(TMP_PREFIX) for entry in root.iterdir())


def _wait(condition, seconds: float, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"writer exited {process.returncode}: {process.stderr.read().decode()[-2000:]}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def _latest_step(root: Path) -> int:
    latest = latest_checkpoint(root)
    return int(latest.name.removeprefix("step-")) if latest else 0


def _check_usable(root: Path) -> int:
    latest = latest_checkpoint(root)
    assert latest is not None, f"no usable checkpoint left in {sorted(p.name for p in root.iterdir())}"
    weights, optimizer, state = read_checkpoint(latest)
    step = state["step"]
    assert latest.name == f"step-{step:06d}" and state["data_position"] == 10 * step
    assert all(torch.equal(w, torch.full_like(w, step)) for w in weights.values()), "weights of two writes mixed"
    assert optimizer["state"], "optimizer state missing"
    return step


def test_a_kill_while_writing_leaves_the_previous_checkpoint(tmp_path):
    """Killed at several points of a write; each time the next writer (a restarted trainer) goes on
    from the checkpoint left, clearing what the dead one left behind."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    step = 0
    for delay in (0.0, 0.02, 0.1, 0.3):
        writer = _writer(root, step + 1)
        try:
            _wait(lambda: _latest_step(root) > step, 120, writer)
            _wait(lambda: _writing(root), 60, writer)
            time.sleep(delay)
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait()
        finally:
            writer.kill()
        step = _check_usable(root)
