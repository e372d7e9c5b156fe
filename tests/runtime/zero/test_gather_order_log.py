"""The gather-order check's log ([Note: gather-order check]): count and hash cover every gather, the
records kept for the error message are bounded, and the message names the first difference."""

import pytest
import torch

from zerospeed.runtime.zero import gather_order_check
from zerospeed.runtime.zero.gather_order_check import GatherOrderCheck


def _check(ids: list[tuple[int, ...]]) -> GatherOrderCheck:
    check = GatherOrderCheck(None, lambda module_id: f"m{module_id}", torch.device("cpu"))
    for i, ds_ids in enumerate(ids):
        check.record(i, forward=True, prefetch=False, ds_ids=ds_ids)
    return check


def _describe(checks: list[GatherOrderCheck]) -> str:
    logs = [(check._count, check._records) for check in checks]
    return checks[0]._describe(logs, list(range(len(checks))), "at the end of backward")


def test_records_are_bounded_and_the_hash_covers_every_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = [(i, i + 1) for i in range(6)]
    unbounded = _check(ids)
    monkeypatch.setattr(gather_order_check, "LOGGED_GATHERS", 2)
    bounded = _check(ids)
    assert len(bounded._records) == 2 and bounded._count == 6 == len(unbounded._records)
    assert bounded._hash == unbounded._hash
    assert _check(ids[:5] + [(9,)])._hash != bounded._hash   # a difference past the kept records counts


def test_the_message_names_the_first_difference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gather_order_check, "LOGGED_GATHERS", 3)
    message = _describe([_check([(0,), (1,), (2,)]), _check([(0,), (5,)])])
    assert "First difference, gather #1 of this micro-step" in message
    assert "rank 0: m1 (forward), parameters ds_id [1]" in message
    assert "rank 1: m1 (forward), parameters ds_id [5]" in message
    message = _describe([_check([(0,), (1,)]), _check([(0,), (1,), (2,)])])
    assert "rank 0: no such gather (it gathered 2 times)" in message
    message = _describe([_check([(i,) for i in range(5)]), _check([(i,) for i in range(4)] + [(7,)])])
    assert "gather #3 of this micro-step" in message
    assert "rank 1: not logged (only the first 3 gathers of a micro-step are; it gathered 5 times)" in message
