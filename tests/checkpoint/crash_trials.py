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
_TIMEOUT_S = 1800  # generous: a loaded machine runs these jobs many times slower


def start_ranks(save_dir: str, stage: int, world_size: int, steps: int, tags: str,
                **extra_env: str) -> list[subprocess.Popen] | list[ForkedRank]:
    """Start the job's ranks, one process each, with a fresh file rendezvous: new interpreters, or
    forks of a warm server after `use_forkserver()`."""
    rendezvous = tempfile.mktemp(prefix="zs-crash-rdzv-")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(world_size), "ZS_TEST_RDZV": rendezvous,
           **extra_env}
    env.pop(CRASH_ENV, None)
    argv = [SCRIPT, save_dir, str(stage), str(steps), tags]
    if _forkserver is not None:
        return [ForkedRank(_forkserver, argv, {**env, "RANK": str(rank)}) for rank in range(world_size)]
    return [subprocess.Popen([sys.executable, *argv], env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for rank in range(world_size)]


# [Note: warm ranks] A rank started as a new interpreter spends most of a short trial importing
# torch and zerospeed (about 2 s of a 3 s trial on a quiet machine, 20-40 s on a loaded one). The
# benchmark instead forks each rank from a multiprocessing fork server that imported crash_save.py
# (so torch, zerospeed and the model code) once. A forked rank is still its own process with its
# own gloo group, killed by the same SIGKILL, and runs the same crash_save.main(); only the import
# is shared. Nothing has run in the server but imports, so there is no thread or lock to inherit.
_forkserver = None


def use_forkserver(modules_file: str | None = None) -> None:
    """Start ranks as forks of a warm server (see [Note: warm ranks]); `modules_file`: the module
    names a finished rank had imported (`golden_run(..., modules_out=)`), imported by the server."""
    import multiprocessing

    global _forkserver
    if _forkserver is None:
        # The server is a new interpreter started from this environment at the first fork; on
        # Python 3.11 it does not take the parent's sys.path before importing its preload modules.
        here, tests = os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(SCRIPT))
        os.environ["PYTHONPATH"] = os.pathsep.join([here, tests, *filter(None, [os.environ.get("PYTHONPATH")])])
        if modules_file:
            os.environ["ZS_CRASH_PRELOAD"] = modules_file
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["crash_warm"])
        _forkserver = context


class ForkedRank:
    """One rank forked from the warm server, with the part of `subprocess.Popen` that trials use."""

    def __init__(self, context, argv: list[str], env: dict[str, str]) -> None:  # noqa: ANN001
        handle, self._log = tempfile.mkstemp(prefix="zs-crash-rank-", suffix=".log")
        os.close(handle)
        self._process = context.Process(target=_forked_rank_main, args=(argv, env, self._log), daemon=False)
        self._process.start()
        self.pid = self._process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self) -> int:
        self._process.join()
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self) -> tuple[str, str]:
        """('', the rank's stdout and stderr together), once it has exited."""
        self.wait()
        with open(self._log, errors="replace") as handle:
            output = handle.read()
        os.remove(self._log)
        return "", output


def _forked_rank_main(argv: list[str], env: dict[str, str], log: str) -> None:
    """In the forked rank: the job's environment and arguments, output to `log`, then crash_save."""
    import traceback

    import crash_save

    os.environ.clear()
    os.environ.update(env)
    sys.argv = argv
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        crash_save.main()  # ends in os._exit(0)
    except BaseException:  # noqa: BLE001 - reported through the log, as a new interpreter's would be
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def finish(ranks: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """Wait for every rank; a rank still running once another died is killed (it waits in a barrier)."""
    deadline = time.monotonic() + _TIMEOUT_S
    while any(r.poll() is None for r in ranks) and time.monotonic() < deadline:
        if any(r.poll() not in (None, 0) for r in ranks):
            time.sleep(0.2)
            break
        time.sleep(0.02)
    timed_out = time.monotonic() >= deadline
    for rank in ranks:
        if rank.poll() is None:
            rank.kill()
    results = [(rank.wait(), rank.communicate()[1]) for rank in ranks]
    if timed_out:
        raise TimeoutError(f"the ranks ran longer than {_TIMEOUT_S} s")
    return results


def run_job(save_dir: str, stage: int, world_size: int, steps: int, tags: str, **extra_env: str) -> list[int]:
    results = finish(start_ranks(save_dir, stage, world_size, steps, tags, **extra_env))
    return [code for code, _ in results] if all(code == 0 for code, _ in results) else _raise_or(results)


def _raise_or(results: list[tuple[int, str]]) -> list[int]:
    if any(code not in (0, -signal.SIGKILL) for code, _ in results):
        raise RuntimeError("a rank failed:\n" + "\n".join(err[-3000:] for _, err in results))
    return [code for code, _ in results]


def golden_run(golden_dir: str, stage: int, world_size: int, steps: int, modules_out: str | None = None) -> Golden:
    """The untouched run: its fp32 weights after every step, and its time per step (train + save).
    `modules_out`: where rank 0 lists the modules it imported (for `use_forkserver`)."""
    extra = {"ZS_CRASH_MODULES_OUT": modules_out} if modules_out else {}
    ranks = start_ranks(golden_dir, stage, world_size, steps, "default", **extra)
    while not os.path.exists(f"{golden_dir}.saving") and all(r.poll() is None for r in ranks):
        time.sleep(0.002)
    start = time.monotonic()
    _raise_or(finish(ranks))
    seconds_per_step = (time.monotonic() - start) / steps
    times = [float(line.split()[1]) for line in _timing(golden_dir)]
    save_windows = list(zip(times[0::2], times[1::2]))
    states = {step: get_fp32_state_dict_from_zero_checkpoint(golden_dir, tag=f"global_step{step}")
              for step in range(1, steps + 1)}
    return Golden(stage, world_size, steps, states, seconds_per_step, save_windows)


def _timing(save_dir: str) -> list[str]:
    try:
        with open(f"{save_dir}.timing") as handle:
            return [line for line in handle if line.strip()]
    except OSError:
        return []


def _peer_died(output: str) -> bool:
    """A rank that raised because the watcher had already killed its peer (the ranks die up to
    20 ms apart): gloo's error for a dead peer ended it, the consequence of the kill and no fault.
    What it left on disk is checked like the rest."""
    return "RuntimeError" in output and any(
        phrase in output for phrase in ("Connection reset by peer", "Connection closed by peer", "Broken pipe"))


def _wait_for_save_start(save_dir: str, index: int, ranks: list) -> None:
    """Until rank 0 has started the `index`-th save of this run (its `start` line), or a rank ended."""
    while all(r.poll() is None for r in ranks):
        if sum(line.startswith("start") for line in _timing(save_dir)) > index:
            return
        time.sleep(0.001)


def completed_steps(save_dir: str) -> int:
    path = f"{save_dir}.progress"
    if not os.path.exists(path):
        return 0
    with open(path) as handle:
        lines = handle.read().split()
    return int(lines[-1]) if lines else 0


def _step_in(tag_dir: str) -> int:
    model_file = next(n for n in sorted(os.listdir(tag_dir)) if n.endswith("model_states.pt"))
    return int(load_file(os.path.join(tag_dir, model_file))["global_steps"])


def saved_step(save_dir: str) -> int:
    """The step of the checkpoint `latest` names (0 without one). It can be ahead of
    `completed_steps`: a kill after a save committed but before it returned on every rank."""
    tag = read_latest(save_dir)
    return 0 if tag is None else _step_in(resolve_tag_dir(save_dir, tag))


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
    step = _step_in(tag_dir)
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
    mid_save: bool     # ... and rank 0 was inside save_checkpoint then
    step: int          # the step the load found
    done: int          # the last step whose save had returned
    error: str = ""    # why the trial counts as lost ("" when it survived)
    startup_s: float = 0.0  # from starting the ranks to their first save (start, init, load)
    check_s: float = 0.0    # the load and comparison after the kill


def random_kill_trial(save_dir: str, golden: Golden, tags: str, rng: random.Random) -> TrialResult:
    """Resume the job in `save_dir` (afresh once it has reached the last step, and at random in one
    trial of four) and SIGKILL every rank at one random moment of one of its saves (a save picked
    at random; from the moment rank 0 starts it in this run, a delay uniform over the golden run's
    duration of that save plus 20%, so a machine slower or faster than during the golden run still
    kills inside the save); the ranks die in random order, up to 20 ms apart. A rank that raises
    because its peer was already killed is the kill's consequence, not a loss. Then check what a
    load finds (`check_recovered`)."""
    # afresh when a resume would not save, and in one trial of four, so that kills keep reaching
    # the early saves too (a run whose last save keeps being killed would resume into it forever)
    if max(completed_steps(save_dir), saved_step(save_dir)) >= golden.steps or rng.random() < 0.25:
        for path in (f"{save_dir}.progress", f"{save_dir}.timing"):
            if os.path.exists(path):
                os.remove(path)
        subprocess.run(["rm", "-rf", save_dir], check=True)
    marker = f"{save_dir}.saving"
    if os.path.exists(marker):
        os.remove(marker)
    remaining = golden.steps - max(completed_steps(save_dir), saved_step(save_dir))
    started = time.monotonic()
    ranks = start_ranks(save_dir, golden.stage, golden.world_size, golden.steps, tags)
    while not os.path.exists(marker) and all(r.poll() is None for r in ranks):
        time.sleep(0.002)
    startup_s = time.monotonic() - started
    index = rng.randrange(remaining)
    start, end = golden.save_windows[index]
    _wait_for_save_start(save_dir, index, ranks)
    time.sleep(rng.uniform(0.0, 1.2 * (end - start)))
    killed = False
    for rank in rng.sample(ranks, len(ranks)):
        if rank.poll() is None:
            rank.send_signal(signal.SIGKILL)
            killed = True
        time.sleep(rng.uniform(0, 0.02))
    results = finish(ranks)
    done = completed_steps(save_dir)
    timing = _timing(save_dir)
    mid_save = killed and bool(timing) and timing[-1].startswith("start")
    failed = [err for code, err in results if code not in (0, -signal.SIGKILL) and not (killed and _peer_died(err))]
    if failed:
        return TrialResult(killed, mid_save, -1, done, "a rank failed:\n" + "\n".join(err[-2000:] for err in failed))
    checked = time.monotonic()
    try:
        step = check_recovered(save_dir, golden.states)
    except Exception as error:  # noqa: BLE001 - every way of failing to load is a lost checkpoint
        return TrialResult(killed, mid_save, -1, done, f"{type(error).__name__}: {error}", startup_s)
    return TrialResult(killed, mid_save, step, done, "", startup_s, time.monotonic() - checked)
