"""The script the launcher tests run as every rank: ``rank_script.py [--local_rank=N] MODE PID_DIR``.

Modes: ``env`` (gloo all_reduce, print the env as JSON), ``train`` (one zerospeed step of
``launcher_helpers.train_model`` on this rank's shard of the global batch; prints the updated
parameters; reads its rank from mpirun's or srun's variables too), ``raise`` (rank 1 raises, the others
sleep), ``raise_both`` (every rank raises the same error), ``sleep`` (every rank sleeps), ``teardown`` (rank 1 imitates gloo's exit-time abort,
the others exit 0 after ``ZS_TEST_OTHERS_S`` seconds), ``hang`` (rank 1 loops outside any
collective while rank 0 waits in a zerospeed all_reduce), ``slow`` (a step of ``ZS_TEST_SLOW_S``
seconds on every rank between two all_reduces: slow, not hung). Every rank writes its pid and the pid
of a forked ``sleep`` child into PID_DIR, so a test can check that nothing of the job is left.
"""

import json
import os
import subprocess
import sys
import time

# The launcher puts --local_rank=N before the script's own arguments (DeepSpeed's order).
mode, pid_dir, *rest = [a for a in sys.argv[1:] if not a.startswith("--local_rank=")]
# mpirun and srun start the script directly: their own variables carry the rank.
rank = int(next(os.environ[k] for k in ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID") if k in os.environ))
if mode not in ("env", "train"):
    child = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(pid_dir, f"rank{rank}.pids"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}\n")


if mode == "env":
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "CROSS_RANK", "CROSS_SIZE"]
    result = {"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:], "sum": total.item()}
    # One write per line: the ranks share the launcher's stdout, and print() writes "\n" separately.
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()
elif mode == "train":
    import torch
    from launcher_helpers import TRAIN_CONFIG, train_batch, train_model

    import zerospeed
    from zerospeed import comm

    comm.init_distributed("gloo", verbose=False)
    world = comm.get_world_size()
    model = train_model()
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=TRAIN_CONFIG)
    x, y = train_batch()
    shard = slice(rank * 8 // world, (rank + 1) * 8 // world)
    loss = torch.nn.functional.mse_loss(engine(x[shard]), y[shard])
    engine.backward(loss)
    engine.step()
    params = [v for p in engine.module.parameters() for v in p.detach().flatten().tolist()]
    host = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    result = {"rank": rank, "world": world, "host": host, "master": os.environ["MASTER_ADDR"],
              "cross": [os.environ.get("CROSS_RANK"), os.environ.get("CROSS_SIZE")], "args": rest,
              "listed": os.environ.get("ZS_TEST_LIST"),
              "params": params}
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    comm.destroy_process_group()
elif mode == "raise":
    if rank == 1:
        time.sleep(0.5)
        with open(os.path.join(pid_dir, "raised_at"), "w") as f:  # fail-fast is timed from here
            f.write(repr(time.time()))
        raise RuntimeError("boom from rank one")
    time.sleep(300)
elif mode == "raise_both":  # the same exception on both ranks, rank 1 first; SIGTERM is ignored
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def fail():
        raise RuntimeError("boom from every rank")

    time.sleep(0.5 if rank == 1 else 1.5)
    fail()
elif mode in ("hang", "slow"):
    import torch

    from zerospeed import comm

    def stuck_in_data_loader():  # the frame the hang report must show for rank 1
        while True:
            time.sleep(0.05)

    comm.init_distributed("gloo", verbose=False)
    comm.all_reduce(torch.ones(1))
    if mode == "hang" and rank == 1:
        stuck_in_data_loader()
    if mode == "slow":
        time.sleep(float(os.environ["ZS_TEST_SLOW_S"]))
    comm.all_reduce(torch.ones(1))
    child.kill()
    os._exit(0)
elif mode == "sleep":
    time.sleep(300)
elif mode == "teardown":
    if rank == 1:
        sys.stderr.write("terminate called without an active exception\n")
        sys.stderr.flush()
        os.abort()
    time.sleep(float(os.environ.get("ZS_TEST_OTHERS_S", "1")))
    child.kill()
