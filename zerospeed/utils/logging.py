"""The zerospeed logger (DeepSpeed's format and default level) and `log_dist`."""

from __future__ import annotations

import logging
import sys

_FORMAT = "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"


def _create_logger() -> logging.Logger:
    created = logging.getLogger("zerospeed")
    if not created.handlers:
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(logging.Formatter(_FORMAT))
        created.addHandler(handler)
    created.setLevel(logging.WARNING)  # DeepSpeed's default: INFO lines need "log_level": "info"
    created.propagate = False
    return created


logger = _create_logger()


def _current_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log on the given ranks (all when `ranks` is None or contains -1), prefixed with `[Rank r]`."""
    rank = _current_rank()
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


def print_dist(message: str, ranks: list[int] | None = None) -> None:
    rank = _current_rank()
    if ranks is None or -1 in ranks or rank in ranks:
        print(f"[Rank {rank}] {message}", flush=True)
