"""Crash trials: run crash_save.py's ranks, SIGKILL them (at a named hook or at a random moment),
then check that what a load finds is a complete checkpoint equal to the golden run's.

Used by test_crash_safety.py (a few trials on CI) and benchmarks/reliability.py (N >= 50).
A trial is *lost* when the load after the kill fails, finds a damaged file, finds a step older
than the last save that returned, or finds values that differ from the untouched (golden) run's
at that step.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from zerospeed.checkpoint.atomic import CRASH_ENV, read_latest, resolve_tag_dir
from zerospeed.checkpoint.manifest import load_file, verify_files
from zerospeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crash_save.py")
_TIMEOUT_S = 300


def start_ranks(save_dir: str, stage: int, world_size: int, steps: int, tags: str,
                **extra_env: str) -> list[subprocess.Popen]:
    """Start the job's ranks, one process each, with a fresh file rendezvous."""
    rendezvous = tempfile.mktemp(prefix="zs-crash-rdzv-")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(world_size), "ZS_TEST_RDZV": rendezvous,
           **extra_env}
    env.pop(CRASH_ENV, None)
    return [subprocess.Popen([sys.executable, SCRIPT, save_dir, str(stage), str(steps), tags],
                             env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
            for rank in range(world_size)]


def finish(ranks: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """Wait for every rank; a rank still running once another died is killed (it waits in a barrier)."""
    deadline = time.monotonic() + _TIMEOUT_S
    while any(r.poll() is None for r in ranks) and time.monotonic() < deadline:
        if any(r.poll() not in (None, 0) for r in ranks):
            time.sleep(0.2)
            break
        time.sleep(0.02)
    for rank in ranks:
        if rank.poll() is None:
            rank.kill()
    return [(rank.wait(), rank.communicate()[1]) for rank in ranks]


def run_job(save_dir: str, stage: int, world_size: int, steps: int, tags: str, **extra_env: str) -> list[int]:
    results = finish(start_ranks(save_dir, stage, world_size, steps, tags, **extra_env))
    return [code for code, _ in results] if all(code == 0 for code, _ in results) else _raise_or(results)


def _raise_or(results: list[tuple[int, str]]) -> list[int]:
    if any(code not in (0, -signal.SIGKILL) for code, _ in results):
        raise RuntimeError("a rank failed:\n" + "\n".join(err[-3000:] for _, err in results))
    return [code for code, _ in results]


def golden_run(golden_dir: str, stage: int, world_size: int, steps: int) -> Golden:
    """The untouched run: its fp32 weights after every step, and its time per step (train + save)."""
    ranks = start_ranks(golden_dir, stage, world_size, steps, "default")
    while not os.path.exists(f"{golden_dir}.saving") and all(r.poll() is None for r in ranks):
        time.sleep(0.002)
    start = time.monotonic()
    _raise_or(finish(ranks))
    seconds_per_step = (time.monotonic() - start) / steps
    with open(f"{golden_dir}.timing") as handle:
        save_windows = [tuple(float(x) for x in line.split()) for line in handle if line.strip()]
    states = {step: get_fp32_state_dict_from_zero_checkpoint(golden_dir, tag=f"global_step{step}")
              for step in range(1, steps + 1)}
    return Golden(stage, world_size, steps, states, seconds_per_step, save_windows)


def completed_steps(save_dir: str) -> int:
    path = f"{save_dir}.progress"
    if not os.path.exists(path):
        return 0
    with open(path) as handle:
        lines = handle.read().split()
    return int(lines[-1]) if lines else 0


def check_recovered(save_dir: str, golden: dict[int, dict[str, torch.Tensor]]) -> int:
    """Assert that a load finds a complete checkpoint no older than the last finished save, equal
    to the golden run's at its step; return that step (0: nothing saved yet, nothing to find)."""
    done = completed_steps(save_dir)
    tag = read_latest(save_dir)
    if tag is None:
        assert done == 0, f"`latest` is gone, but the save of step {done} had returned"
        return 0
    tag_dir = resolve_tag_dir(save_dir, tag)
    assert verify_files(tag_dir), f"{tag_dir} has no manifest"
    model_file = next(n for n in sorted(os.listdir(tag_dir)) if n.endswith("model_states.pt"))
    step = int(load_file(os.path.join(tag_dir, model_file))["global_steps"])
    assert step >= done, f"loaded step {step}, but the save of step {done} had returned"
    state = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    reference = golden[step]
    assert state.keys() == reference.keys()
    for name, value in state.items():
        assert torch.equal(value, reference[name]), f"{name} at step {step} differs from the golden run"
    return step


@dataclass
class Golden:
    stage: int
    world_size: int
    steps: int
    states: dict[int, dict[str, torch.Tensor]]
    seconds_per_step: float
    save_windows: list[tuple[float, float]]  # (start, end) of the n-th save of a run, from its marker


@dataclass
class TrialResult:
    killed: bool       # the watcher's SIGKILL landed while a rank still ran
    step: int          # the step the load found
    done: int          # the last step whose save had returned
    error: str = ""    # why the trial counts as lost ("" when it survived)


def random_kill_trial(save_dir: str, golden: Golden, tags: str, rng: random.Random) -> TrialResult:
    """Resume the job in `save_dir` (start afresh once it has reached the last step) and SIGKILL
    every rank at one random moment of one of its saves (a save picked at random, then a moment
    uniform over the golden run's duration of that save, padded by 20% each side); the ranks die
    in random order, up to 20 ms apart. Then check what a load finds (`check_recovered`)."""
    if completed_steps(save_dir) >= golden.steps:
        for path in (f"{save_dir}.progress", f"{save_dir}.timing"):
            if os.path.exists(path):
                os.remove(path)
        subprocess.run(["rm", "-rf", save_dir], check=True)
    marker = f"{save_dir}.saving"
    if os.path.exists(marker):
        os.remove(marker)
    remaining = golden.steps - completed_steps(save_dir)
    ranks = start_ranks(save_dir, golden.stage, golden.world_size, golden.steps, tags)
    while not os.path.exists(marker) and all(r.poll() is None for r in ranks):
        time.sleep(0.002)
    start, end = golden.save_windows[rng.randrange(remaining)]
    pad = 0.2 * (end - start)
    time.sleep(max(0.0, rng.uniform(start - pad, end + pad)))
    killed = False
    for rank in rng.sample(ranks, len(ranks)):
        if rank.poll() is None:
            rank.send_signal(signal.SIGKILL)
            killed = True
        time.sleep(rng.uniform(0, 0.02))
    results = finish(ranks)
    done = completed_steps(save_dir)
    if any(code not in (0, -signal.SIGKILL) for code, _ in results):
        return TrialResult(killed, -1, done, "a rank failed:\n" + "\n".join(err[-2000:] for _, err in results))
    try:
        step = check_recovered(save_dir, golden.states)
    except Exception as error:  # noqa: BLE001 - every way of failing to load is a lost checkpoint
        return TrialResult(killed, -1, done, f"{type(error).__name__}: {error}")
    return TrialResult(killed, step, done)
