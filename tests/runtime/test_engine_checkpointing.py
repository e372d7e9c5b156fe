"""Engine checkpointing: load_checkpoint on a missing directory (DeepSpeed's (None, None), with a
warning that says so) and what checkpoint.tag_validation costs and catches per mode."""

import logging

import torch
from distributed import run_on_ranks

import zerospeed
from zerospeed.utils.logging import logger


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _load_missing(missing_dir):
    engine, *_ = zerospeed.initialize(model=torch.nn.Linear(2, 2), config={
        "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    records = _Records()
    logger.addHandler(records)
    try:
        result = engine.load_checkpoint(missing_dir)
    finally:
        logger.removeHandler(records)
    return result, records.messages


def test_load_checkpoint_from_a_missing_directory_says_the_directory_does_not_exist(tmp_path):
    missing = str(tmp_path / "no_such_run")
    for result, messages in run_on_ranks(_load_missing, 1, missing):
        assert result == (None, None)
        assert any(f"checkpoint directory {missing} does not exist" in m for m in messages), messages


def _tag_validation_by_mode(save_dir: str) -> dict:
    """Per checkpoint.tag_validation mode: the all-reduces one save issues (same tag on every rank),
    and what a save under a tag that differs between ranks raises (Ignore would not return)."""
    from zerospeed.comm import comms_logger

    rank = torch.distributed.get_rank()
    out = {}
    for mode in ("Ignore", "Warn", "Fail"):
        engine, *_ = zerospeed.initialize(model=torch.nn.Linear(2, 2), config={
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "checkpoint": {"tag_validation": mode}})
        comms_logger.configure(enabled=True, prof_all=True)
        comms_logger.reset()
        try:
            engine.save_checkpoint(f"{save_dir}/{mode}", tag="t")
            all_reduces = comms_logger.count_by_op().get("all_reduce", 0)
        finally:
            comms_logger.configure(enabled=False)
            comms_logger.reset()
        mismatch = None
        if mode != "Ignore":
            try:
                engine.save_checkpoint(f"{save_dir}/{mode}", tag=f"rank{rank}")
            except ValueError as error:
                mismatch = str(error)
        out[mode] = {"all_reduces": all_reduces, "mismatch": mismatch}
    return out


def test_tag_validation_costs_one_all_reduce_under_warn_and_fail_and_none_under_ignore(tmp_path):
    """DeepSpeed compares the tag only under "Warn" and "Fail" (two all-reduces); here one, and the
    mismatch raises on every rank in both modes (docs/compatibility.md)."""
    for rank, result in enumerate(run_on_ranks(_tag_validation_by_mode, 2, str(tmp_path))):
        assert result["Ignore"] == {"all_reduces": 0, "mismatch": None}, rank
        for mode in ("Warn", "Fail"):
            assert result[mode]["all_reduces"] == 1, (rank, mode)
            assert f"tag 'rank{rank}' of rank {rank} is not the same on all ranks" in result[mode]["mismatch"]
