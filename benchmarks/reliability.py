"""Reliability figures for docs/reliability.md (issue 17's acceptance).

    python benchmarks/reliability.py [--kills N] [--only kills,damage,hang,orphans,configs] [--json out.json]

kills    N random SIGKILL trials per ZeRO stage (1 and 3), 2 ranks, every rank killed at one random
         moment of its saves (tests/checkpoint/crash_trials.py); each followed by a load checked
         against an untouched run's weights. Trials resume from the previous trial's directory,
         so a save after a killed save is exercised too. Reports kills that landed, survived, lost.
damage   every file of a checkpoint (and `latest`) missing / truncated / bit-flipped / junk: the
         engine's resume must refuse it with an error naming the file.
hang     one rank stops outside collectives: the launcher's hang report within the configured time,
         with every rank's stack; and a slow step that must not trip it.
orphans  the launcher SIGKILLed: processes of the job left alive afterwards.
configs  bad ds_configs: refused at `initialize` with an error naming the key.
Runs on CPU (gloo); takes about 20-40 minutes on 2 loaded cores with the default N = 30.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for sub in ("tests", os.path.join("tests", "checkpoint"), os.path.join("tests", "launcher")):
    sys.path.insert(0, os.path.join(ROOT, sub))
os.environ.setdefault("ZS_ACCELERATOR", "cpu")


def kills(trials_per_stage: int, stages: tuple[int, ...] = (1, 3), seed: int = 17, warm: bool = True) -> dict:
    import torch
    from crash_trials import golden_run, random_kill_trial, use_forkserver


    out: dict = {}
    for stage in stages:
        work = tempfile.mkdtemp(prefix=f"zs-kills-s{stage}-")
        modules = os.path.join(work, "modules.txt")
        golden = golden_run(os.path.join(work, "golden"), stage, 2, 4, modules_out=modules)
        if warm:  # ranks forked from a server that imported what a rank imports ([Note: warm ranks])
            use_forkserver(modules)
            # again, forked: the save windows the kills aim at are a warm rank's, and a forked rank
            # must reproduce the new interpreters' run bit for bit
            cold, golden = golden, golden_run(os.path.join(work, "golden_warm"), stage, 2, 4)
            assert all(torch.equal(cold.states[step][name], value) for step, state in golden.states.items()
                       for name, value in state.items()), "forked ranks differ from new interpreters"
        rng = random.Random(seed + stage)
        landed = survived = mid_save = survived_mid_save = 0
        lost: list[str] = []
        save_dir = os.path.join(work, "ckpt")
        started = time.monotonic()
        for trial in range(trials_per_stage):
            trial_start = time.monotonic()
            result = random_kill_trial(save_dir, golden, "a,a,b", rng)
            landed += result.killed
            mid_save += result.mid_save
            survived_mid_save += result.mid_save and not result.error
            if result.error:
                lost.append(result.error)
                shutil.move(save_dir, os.path.join(work, f"lost{trial}"))  # keep it for a post-mortem
                for side in (".progress", ".saving"):
                    if os.path.exists(save_dir + side):
                        os.remove(save_dir + side)
            elif result.killed:
                survived += 1
            print(f"stage {stage} trial {trial}: killed={result.killed} mid_save={result.mid_save} step={result.step} "
                  f"done={result.done} {time.monotonic() - trial_start:.1f}s (start-up {result.startup_s:.1f}s, "
                  f"check {result.check_s:.1f}s) "
                  f"{'LOST ' + result.error[:200] if result.error else 'ok'}", flush=True)
        out[f"stage{stage}"] = {"trials": trials_per_stage, "kills_landed": landed, "survived": survived,
                                "kills_mid_save": mid_save, "survived_mid_save": survived_mid_save,
                                "lost": len(lost), "lost_errors": lost[:5],
                                "seconds_per_step": round(golden.seconds_per_step, 3),
                                "seconds_per_trial": round((time.monotonic() - started) / max(1, trials_per_stage), 2)}
        shutil.rmtree(work, ignore_errors=True)
    return out


def _damage(path: str, how: str) -> None:
    if how == "missing":
        os.remove(path)
        return
    with open(path, "rb") as handle:
        data = bytearray(handle.read())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "flipped":
        data[len(data) // 2] ^= 0xFF
    else:  # junk
        data = bytearray(b"\xff\xfe\x00junk\x81")
    with open(path, "wb") as handle:
        handle.write(bytes(data))


def _saved_checkpoint(save_dir: str, stage: int) -> None:
    import torch

    import zerospeed
    from crash_save import batch, config
    from parity import make_model

    engine, _, _, _ = zerospeed.initialize(model=make_model(), config=config(stage, 1))
    engine.backward(engine(*batch(1, 0)))
    engine.step()
    engine.save_checkpoint(save_dir, tag="a")
    torch.manual_seed(0)


def _resume_error(save_dir: str, stage: int) -> str:
    import zerospeed
    from crash_save import config
    from parity import make_model

    engine, _, _, _ = zerospeed.initialize(model=make_model(), config=config(stage, 1))
    try:
        path, _ = engine.load_checkpoint(save_dir)
    except Exception as error:  # noqa: BLE001 - the message is what is measured
        return f"{type(error).__name__}: {error}"
    return f"loaded {path}"


def damage() -> dict:
    """Every damaged file must make `engine.load_checkpoint` fail with its path in the error
    (one process, world size 1, ZeRO stages 1 and 3: one engine per case)."""
    import torch.distributed as dist

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    work = tempfile.mkdtemp(prefix="zs-damage-")
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{work}/rdzv", rank=0, world_size=1)
    refused, failures, total = 0, [], 0
    for stage in (1, 3):
        good = os.path.join(work, f"good{stage}")
        _saved_checkpoint(good, stage)
        cases = [(name, how) for name in sorted(os.listdir(os.path.join(good, "a")))
                 for how in ("missing", "truncated", "flipped")]
        cases += [("../latest", "junk"), ("../latest", "truncated"), ("../latest", "missing_tag_dir")]
        for index, (name, how) in enumerate(cases):
            save_dir = os.path.join(work, f"s{stage}case{index}")
            shutil.copytree(good, save_dir)
            path = os.path.normpath(os.path.join(save_dir, "a", name))
            if how == "missing_tag_dir":  # `latest` names a tag whose directory is gone
                shutil.rmtree(os.path.join(save_dir, "a"))
                path = os.path.join(save_dir, "a")
            else:
                _damage(path, how)
            message = _resume_error(save_dir, stage)
            named = not message.startswith("loaded") and path in message
            total += 1
            refused += named
            if not named:
                failures.append(f"stage {stage} {name} {how}: {message[:300]}")
            print(f"damage stage {stage} {name} {how}: {'refused, named' if named else 'NOT NAMED: ' + message[:200]}",
                  flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return {"cases": total, "refused_and_named": refused, "failures": failures}


def hang() -> dict:
    from test_hang_report import run_hang_job

    timeout_s = 5.0
    start = time.monotonic()
    code, stderr, elapsed = run_hang_job("hang", timeout_s)
    stacks = sum(f"Python stack of rank {r}" in stderr for r in range(2))
    slow_code, _, _ = run_hang_job("slow", timeout_s)
    return {"configured_s": timeout_s, "exit_code": code, "reported_after_s": round(elapsed, 1),
            "stacks_printed": stacks, "ranks": 2, "names_rank_1": "rank 1 is not in a collective" in stderr,
            "slow_step_exit_code": slow_code, "wall_s": round(time.monotonic() - start, 1)}


def orphans(trials: int = 5) -> dict:
    from launcher_helpers import SCRIPT, alive, env, launcher_argv, wait_for_pid_files

    left = 0
    for _ in range(trials):
        pid_dir = tempfile.mkdtemp(prefix="zs-orphans-")
        proc = subprocess.Popen(launcher_argv("--num_gpus", "2", SCRIPT, "sleep", pid_dir),
                                env=env(ZS_KILL_GRACE_S="1"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        pids = wait_for_pid_files(pid_dir, 2, timeout_s=120)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while alive(pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        left += len(alive(pids))
        shutil.rmtree(pid_dir, ignore_errors=True)
    return {"launcher_sigkills": trials, "processes_per_job": 4, "orphans_left": left}


def configs() -> dict:
    from bad_configs import run_bad_configs

    return run_bad_configs()


SECTIONS = {"kills": None, "damage": damage, "hang": hang, "orphans": orphans, "configs": configs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=30, help="random-kill trials per stage (stages 1 and 3)")
    parser.add_argument("--stages", default="1,3", help="ZeRO stages of the kill trials")
    parser.add_argument("--seed", type=int, default=17, help="of the kill moments (run several seeds in parallel)")
    parser.add_argument("--cold", action="store_true",
                        help="start every kill trial's ranks as new interpreters (slower; the CI tests' way)")
    parser.add_argument("--only", default=",".join(SECTIONS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = {}
    for name in args.only.split(","):
        start = time.monotonic()
        if name == "kills":
            results[name] = kills(args.kills, tuple(int(s) for s in args.stages.split(",")), args.seed, not args.cold)
        else:
            results[name] = SECTIONS[name]()
        results[name]["section_wall_s"] = round(time.monotonic() - start, 1)
        print(json.dumps({name: results[name]}, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
