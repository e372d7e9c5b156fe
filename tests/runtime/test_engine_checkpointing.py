"""load_checkpoint on a directory that does not exist: DeepSpeed's (None, None), with a warning that says so."""

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
