"""Monitors write real files that read back to the values written; only rank 0 writes."""

from __future__ import annotations

import csv
import os
import types

import pytest

from distributed import run_on_ranks

EVENTS = [("Train/Samples/train_loss", 2.5, 8), ("Train/Samples/lr", 1e-3, 8),
          ("Train/Samples/train_loss", 2.25, 16), ("Train/Samples/lr", 2e-3, 16)]


def _monitor_config(tmp_dir: str, tensorboard: bool = False, csv_monitor: bool = False):
    # The real config model: a fake one on ImportError would hide a broken zerospeed.monitor.config.
    from zerospeed.monitor.config import DeepSpeedMonitorConfig

    return DeepSpeedMonitorConfig(
        tensorboard={"enabled": tensorboard, "output_path": os.path.join(tmp_dir, "tb"), "job_name": "job"},
        csv_monitor={"enabled": csv_monitor, "output_path": os.path.join(tmp_dir, "csv"), "job_name": "job"},
    )


def _read_tensorboard(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(log_dir)
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def _read_csv(log_dir: str) -> dict[str, list[list[str]]]:
    tables = {}
    for name in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, name), newline="") as handle:
            tables[name] = list(csv.reader(handle))
    return tables


def _expected(tag: str) -> list[tuple[int, float]]:
    return [(step, value) for t, value, step in EVENTS if t == tag]


def test_tensorboard_events_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from zerospeed.monitor.monitor import MonitorMaster

    master = MonitorMaster(_monitor_config(str(tmp_path), tensorboard=True))
    assert master.enabled and len(master.writers) == 1
    master.write_events(EVENTS)
    master.close()
    scalars = _read_tensorboard(os.path.join(tmp_path, "tb", "job"))
    assert set(scalars) == {"Train/Samples/train_loss", "Train/Samples/lr"}
    for tag, read in scalars.items():
        assert [step for step, _ in read] == [step for step, _ in _expected(tag)]
        assert [value for _, value in read] == pytest.approx([value for _, value in _expected(tag)], rel=1e-6)


def test_csv_layout_matches_deepspeed(tmp_path):
    from zerospeed.monitor.monitor import MonitorMaster

    master = MonitorMaster(_monitor_config(str(tmp_path), csv_monitor=True))
    master.write_events(EVENTS[:2])
    master.write_events(EVENTS[2:])  # appended, one header per file
    tables = _read_csv(os.path.join(tmp_path, "csv", "job"))
    assert tables == {
        "Train_Samples_lr.csv": [["step", "lr"], ["8", "0.001"], ["16", "0.002"]],
        "Train_Samples_train_loss.csv": [["step", "train_loss"], ["8", "2.5"], ["16", "2.25"]],
    }


def test_disabled_master_writes_nothing(tmp_path):
    from zerospeed.monitor.monitor import MonitorMaster

    master = MonitorMaster(_monitor_config(str(tmp_path)))
    assert not master.enabled and master.writers == []
    master.write_events(EVENTS)
    assert not os.path.exists(tmp_path / "tb") and not os.path.exists(tmp_path / "csv")


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb to run this test)")
    from zerospeed.monitor.wandb import WandbMonitor

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monitor = WandbMonitor(types.SimpleNamespace(enabled=True, project="zerospeed-test", group=None, team=None))
    monitor.write_events(EVENTS)
    history = monitor.run.summary
    assert history["Train/Samples/train_loss"] == pytest.approx(2.25)
    monitor.close()
    assert any(name.startswith("offline-run") for name in os.listdir(tmp_path / "wandb"))


def test_missing_backend_names_the_package(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_comet(name, *args, **kwargs):
        if name == "comet_ml":
            raise ImportError("No module named 'comet_ml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_comet)
    from zerospeed.monitor.comet import CometMonitor

    with pytest.raises(ImportError, match="comet_ml is not installed"):
        CometMonitor(types.SimpleNamespace(enabled=True, samples_log_interval=100))


def _write_on_every_rank(tmp_dir: str) -> list[str]:
    import torch.distributed as dist

    from zerospeed.monitor.monitor import MonitorMaster

    master = MonitorMaster(_monitor_config(tmp_dir, tensorboard=True, csv_monitor=True))
    rank = dist.get_rank()
    master.write_events([(tag, value + rank, step) for tag, value, step in EVENTS])  # rank 1 would differ
    master.close()
    return [type(writer).__name__ for writer in master.writers]


def test_two_ranks_only_rank_zero_writes(tmp_path):
    pytest.importorskip("tensorboard")
    writers = run_on_ranks(_write_on_every_rank, 2, str(tmp_path))
    assert writers == [["TensorBoardMonitor", "csvMonitor"], []]
    scalars = _read_tensorboard(os.path.join(tmp_path, "tb", "job"))
    assert [v for _, v in scalars["Train/Samples/train_loss"]] == pytest.approx([2.5, 2.25])
    assert len(os.listdir(os.path.join(tmp_path, "tb", "job"))) == 1  # one event file: one writer
    tables = _read_csv(os.path.join(tmp_path, "csv", "job"))
    assert tables["Train_Samples_train_loss.csv"][1:] == [["8", "2.5"], ["16", "2.25"]]
