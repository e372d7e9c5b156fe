"""Side-by-side training benchmark: zerospeed and its peers on the same model, data and optimizer.

Each (system, stage) runs in fresh processes (so peak RSS is its own), 2 ranks x 1 thread over
gloo, file rendezvous. Rounds alternate the systems so machine noise hits all of them alike.
Measured per run (slowest / largest rank): median and minimum step wall time, median process CPU
time, median forward / backward / optimizer-step time, peak RSS over the run and within each phase
(benchmarks/memory.py), the live tensor state after the optimizer step, payload bytes communicated
per step per rank, and the final loss.

Bytes: zerospeed through its comms logger; DDP through a comm hook that counts each bucket;
FSDP2 and DeepSpeed by counting the torch.distributed tensor collectives they call.

`spawn_ranks` and `finish_rank` start and end the ranks of every benchmark here that hands
results back through a queue (a failed or stuck rank raises, naming the benchmark, never hangs).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from memory import PeakRss, StateProbe

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

MODELS = {  # GPT-2-style, byte-level, tied LM head
    "tiny": dict(n_layer=2, n_head=4, n_embd=128, block_size=128),
    "small": dict(n_layer=9, n_head=8, n_embd=256, block_size=256),
    "medium": dict(n_layer=8, n_head=8, n_embd=704, block_size=256),
    # issue 21's shapes: few wide layers, where per-layer buffers (not layer count) set the costs
    "wide4": dict(n_layer=4, n_head=6, n_embd=384, block_size=128),     # 7.25M params
    "wide10": dict(n_layer=10, n_head=10, n_embd=640, block_size=256),  # 49.6M params
    # issue 33: GPT-2's vocabulary on wide4's body, where the (tied) embedding dominates (26.6M params)
    "vocab50k": dict(n_layer=4, n_head=6, n_embd=384, block_size=128, vocab_size=50304),
}
MICRO_BATCH = {"wide4": 8, "vocab50k": 8}  # per model; 4 otherwise


@dataclasses.dataclass
class RunSpec:
    system: str            # zerospeed | ddp | fsdp2 | deepspeed
    stage: int = 0
    dtype: str = "fp32"    # fp32 | bf16
    model: str = "small"
    steps: int = 12
    warmup: int = 3
    micro_batch: int = 4
    world_size: int = 2
    zero_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)  # extra zero_optimization keys
    torch_adam: bool = True  # False: each system's fused CPU Adam (what DeepSpeed builds for offload)
    tag: str = ""            # appended to the label (e.g. the offload device)

    @property
    def label(self) -> str:
        return f"{self.system}" + (f"-z{self.stage}" if self.system in ("zerospeed", "deepspeed") else "") + \
            ("" if self.dtype == "fp32" else f"-{self.dtype}") + (f"-{self.tag}" if self.tag else "")


@dataclasses.dataclass
class RunResult:
    label: str
    step_s: float
    cpu_s: float
    peak_rss_mib: float
    comm_mib_per_step: float
    final_loss: float
    phases_s: tuple[float, float, float] = (0.0, 0.0, 0.0)  # median forward, backward, step (slowest rank)
    step_min_s: float = 0.0
    phase_peak_mib: tuple[float, float, float] = (0.0, 0.0, 0.0)  # peak RSS within forward, backward, step
    state_mib: float = 0.0            # live tensors after the optimizer step, touched pages
    state_allocated_mib: float = 0.0  # the same, whole storages


def median_results(results: list[RunResult]) -> RunResult:
    """One run's figures, each the median over `results` (repeated runs of one spec)."""
    def median(name: str) -> Any:
        values = [getattr(r, name) for r in results]
        if isinstance(values[0], tuple):
            return tuple(statistics.median(v[i] for v in values) for i in range(len(values[0])))
        return statistics.median(values)

    return RunResult(results[0].label, **{f.name: median(f.name) for f in dataclasses.fields(RunResult)
                                          if f.name != "label"})


# --- byte counting for peers ---------------------------------------------------------------------

class _CollectiveCounter:
    """Counts payload bytes of torch.distributed tensor collectives (patched module attributes).

    The comms logger's convention: the whole tensor of an all-reduce, the gathered (output) tensor
    of an all-gather, the full (input) tensor of a reduce-scatter; the number is the argument index.
    """

    NAMES = {"all_reduce": 0, "all_gather_single": 0, "all_gather_into_tensor": 0, "_all_gather_base": 0,
             "reduce_scatter_single": 1, "reduce_scatter_tensor": 1, "_reduce_scatter_base": 1,
             "broadcast": 0, "all_to_all_single": 1}

    def __init__(self) -> None:
        self.bytes = 0
        self.active = False

    def install(self) -> None:
        for name, arg_index in self.NAMES.items():
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(original, arg_index))

    def _wrap(self, fn: Any, arg_index: int) -> Any:
        keywords = ("tensor", "output", "output_tensor") if arg_index == 0 else ("input", "input_tensor")

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                tensor = args[arg_index] if len(args) > arg_index else \
                    next((kwargs[k] for k in keywords if k in kwargs), None)
                if torch.is_tensor(tensor):
                    self.bytes += tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)

        return counted


def _ddp_counting_hook(counter: _CollectiveCounter) -> Any:
    def hook(state: Any, bucket: Any) -> torch.futures.Future:
        tensor = bucket.buffer()
        if counter.active:
            counter.bytes += tensor.numel() * tensor.element_size()
        tensor.div_(dist.get_world_size())
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])

    # DDP checks the annotations themselves (strings under `from __future__ import annotations`).
    hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                            "return": torch.futures.Future[torch.Tensor]}
    return hook


# --- one run -------------------------------------------------------------------------------------

def _batches(spec: RunSpec, rank: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from gpt import ByteWindows, stdlib_bytes

    dataset = ByteWindows(stdlib_bytes(2_000_000), block_size)
    batches = []
    for step in range(spec.steps):
        start = (step * spec.world_size + rank) * spec.micro_batch
        rows = [dataset[i] for i in range(start, start + spec.micro_batch)]
        batches.append((torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])))
    return batches


def _ds_config(spec: RunSpec) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": spec.micro_batch, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01,
                                                   "torch_adam": spec.torch_adam}},
        "gradient_clipping": 0.0, "zero_optimization": {"stage": spec.stage, **spec.zero_overrides},
    }
    if spec.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _build(spec: RunSpec, model: torch.nn.Module, counter: _CollectiveCounter,
           after_step: Callable[..., None]) -> tuple[Any, Any, Any]:
    """(forward_fn, backward_fn, step_fn) for the system under test; `after_step` is called right
    after each step of the torch optimizer (inside an engine's step: before its parameter all-gather
    and zero_grad), where parameters, gradients and optimizer state all live."""
    if spec.system == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(None, _ddp_counting_hook(counter))
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
        optimizer.register_step_post_hook(after_step)
        autocast = spec.dtype == "bf16"

        def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                return ddp(x, y)

        return forward, lambda loss: loss.backward(), lambda: (optimizer.step(), optimizer.zero_grad())
    if spec.system == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if spec.dtype == "bf16" else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
        optimizer.register_step_post_hook(after_step)
        counter.install()
        return model, lambda loss: loss.backward(), lambda: (optimizer.step(), optimizer.zero_grad())
    if spec.system == "zerospeed":
        import zerospeed

        config = _ds_config(spec)
        config["comms_logger"] = {"enabled": True}
        engine, _, _, _ = zerospeed.initialize(model=model, config=config)
        _torch_optimizer(engine.optimizer).register_step_post_hook(after_step)
        return engine, engine.backward, engine.step
    if spec.system == "deepspeed":
        counter.install()  # before the import: deepspeed.comm binds torch.distributed's functions
        import deepspeed

        engine, _, _, _ = deepspeed.initialize(model=model, config=_ds_config(spec))
        _torch_optimizer(engine.optimizer).register_step_post_hook(after_step)
        return engine, engine.backward, engine.step
    raise ValueError(spec.system)


def _torch_optimizer(wrapper: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside an engine's optimizer wrapper(s)."""
    while not isinstance(wrapper, torch.optim.Optimizer) or isinstance(getattr(wrapper, "optimizer", None),
                                                                        torch.optim.Optimizer):
        wrapper = wrapper.optimizer
    return wrapper


def _comm_bytes(spec: RunSpec, counter: _CollectiveCounter) -> int:
    if spec.system == "zerospeed":
        from zerospeed.comm import comms_logger

        return sum(r.msg_bytes for r in comms_logger.records if r.op != "barrier")
    return counter.bytes


def _reset_comm(spec: RunSpec, counter: _CollectiveCounter, active: bool) -> None:
    counter.bytes, counter.active = 0, active
    if spec.system == "zerospeed":
        from zerospeed.comm import comms_logger

        comms_logger.reset()


def _worker(rank: int, spec: RunSpec, init_file: str, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(spec.world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", ZS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=spec.world_size)
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(**MODELS[spec.model])
    model = GPT(config)
    counter, state_probe = _CollectiveCounter(), StateProbe()
    forward, backward, step = _build(spec, model, counter, state_probe)
    rss = PeakRss()
    init_peak_mib = rss.read_mib()
    step_times, cpu_times, phase_times, phase_peaks, loss = [], [], [], [0.0, 0.0, 0.0], torch.zeros(())
    for index, (x, y) in enumerate(_batches(spec, rank, config.block_size)):
        measured = index >= spec.warmup
        if index == spec.warmup:
            _reset_comm(spec, counter, active=True)
        if index == max(spec.warmup - 1, 0):
            state_probe.arm()  # in the last warm-up step: optimizer state exists, time is not measured
        rss.reset()
        wall0, cpu0 = time.perf_counter(), time.process_time()
        loss = forward(x, y)
        wall1, peak0 = time.perf_counter(), rss.read_mib()
        rss.reset()
        backward(loss)
        wall2, peak1 = time.perf_counter(), rss.read_mib()
        rss.reset()
        step()
        wall3, peak2 = time.perf_counter(), rss.read_mib()
        phase_peaks = [max(a, b) for a, b in zip(phase_peaks, (peak0, peak1, peak2))]
        if measured:
            step_times.append(wall3 - wall0)
            cpu_times.append(time.process_time() - cpu0)
            phase_times.append((wall1 - wall0, wall2 - wall1, wall3 - wall2))
    measured_steps = spec.steps - spec.warmup
    comm_per_step = _comm_bytes(spec, counter) / measured_steps
    counter.active = False
    stats = torch.tensor([statistics.median(step_times), statistics.median(cpu_times),
                          max(init_peak_mib, *phase_peaks), comm_per_step, float(loss.float().item())] +
                         [statistics.median(p[i] for p in phase_times) for i in range(3)] +
                         [min(step_times), *phase_peaks, *state_probe.mib], dtype=torch.float64)
    gathered = [torch.zeros_like(stats) for _ in range(spec.world_size)]
    dist.all_gather(gathered, stats)
    result = None
    if rank == 0:
        table = torch.stack(gathered)
        largest = table.max(dim=0).values.tolist()  # the slowest / largest rank, per figure
        result = RunResult(spec.label, step_s=largest[0], cpu_s=largest[1], peak_rss_mib=largest[2],
                           comm_mib_per_step=largest[3] / 2**20, final_loss=float(table[:, 4].mean()),
                           phases_s=(largest[5], largest[6], largest[7]), step_min_s=largest[8],
                           phase_peak_mib=(largest[9], largest[10], largest[11]),
                           state_mib=largest[12], state_allocated_mib=largest[13])
    finish_rank(results, result)


def finish_rank(results: Any, item: Any = None) -> NoReturn:
    """End a benchmark rank: put `item` (unless None) on the `results` queue, wait for the other
    ranks, and leave with os._exit, which skips gloo's teardown (it intermittently aborts at exit;
    docs/testing.md). os._exit also skips the queue's flush at exit, and `put` only hands the item
    to a feeder thread: without close + join_thread the item can die with the process."""
    if item is not None:
        results.put(item)
        results.close()
        results.join_thread()
    dist.barrier()
    os._exit(0)


def spawn_ranks(target: Callable[..., None], world_size: int, *args: Any, label: str, num_results: int = 1,
                timeout_s: float = 3600.0) -> list[Any]:
    """Run `target(rank, *args, init_file, results)` in `world_size` fresh spawned processes and
    return the first `num_results` items they put on `results` (finish_rank), in arrival order.
    `init_file` is a rendezvous file in a temporary directory (gloo's `file://` init, no ports).

    When a rank exits non-zero, every rank exits with no result, or `timeout_s` passes first,
    every rank is killed and the error names the benchmark script and `label`: no hang. Ranks
    still alive a minute after the results are in are killed too (a lost barrier partner)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="zs-bench-") as tmp:
        ranks = [context.Process(target=target, args=(rank, *args, os.path.join(tmp, "rdzv"), results))
                 for rank in range(world_size)]
        for process in ranks:
            process.start()
        name = f"{os.path.basename(sys.argv[0])} {label}"
        try:
            items = _collect(results, ranks, num_results, name, timeout_s)
        except BaseException:
            _reap(ranks, grace_s=0.0)
            raise
        exit_codes = _reap(ranks, grace_s=60.0)
    if any(exit_codes.values()):  # the results are in: worth a line, not a failed run
        print(f"{name}: ranks exited with {exit_codes} (rank: exit code)", file=sys.stderr, flush=True)
    return items


def _collect(results: Any, ranks: list[Any], num_results: int, name: str, timeout_s: float) -> list[Any]:
    import queue

    deadline = time.monotonic() + timeout_s
    items: list[Any] = []
    while len(items) < num_results:
        # Exit codes are read before the get: finish_rank flushes its item before the rank exits,
        # so the item of a rank seen gone here is in the pipe already, and the get below finds it.
        exit_codes = {rank: process.exitcode for rank, process in enumerate(ranks)}
        try:
            items.append(results.get(timeout=2.0))
            continue
        except queue.Empty:
            pass
        failed = {rank: code for rank, code in exit_codes.items() if code not in (None, 0)}
        if failed:
            raise RuntimeError(f"{name}: rank(s) exited with {failed} (rank: exit code) with {len(items)} of "
                               f"{num_results} result(s) in; see the traceback above") from None
        if None not in exit_codes.values():
            raise RuntimeError(f"{name}: every rank exited cleanly, with {len(items)} of {num_results} result(s)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: {len(items)} of {num_results} result(s) after {timeout_s:.0f} s")
    return items


def _reap(ranks: list[Any], grace_s: float) -> dict[int, int]:
    """Join the ranks, killing those still alive after `grace_s` (e.g. one stuck at its last
    barrier); their exit codes by rank."""
    deadline = time.monotonic() + grace_s
    for process in ranks:
        process.join(timeout=max(deadline - time.monotonic(), 0.0))
        if process.is_alive():
            process.kill()
            process.join()
    return {rank: process.exitcode for rank, process in enumerate(ranks)}


def run(spec: RunSpec) -> RunResult:
    """One run of `spec` in fresh processes: rank 0's figures (the slowest / largest rank's)."""
    return spawn_ranks(_worker, spec.world_size, spec, label=spec.label)[0]
