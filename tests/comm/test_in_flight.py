"""InFlightQueue: the bound holds after every submit and work finishes in issue order."""

import pytest

from zerospeed.comm.in_flight import InFlightQueue


class _Handle:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(f"wait {self.name}")


@pytest.mark.parametrize("max_outstanding", [0, 1, 2])
def test_bound_and_order(max_outstanding):
    log = []
    queue = InFlightQueue(max_outstanding)
    for i in range(4):
        queue.submit(_Handle(log, i), lambda i=i: log.append(f"finish {i}"))
        assert len(queue) == min(i + 1, max_outstanding)
    queue.drain()
    assert len(queue) == 0
    assert log == [entry for i in range(4) for entry in (f"wait {i}", f"finish {i}")]


def test_synchronous_work_has_no_handle_and_bad_bound_is_rejected():
    done = []
    InFlightQueue(0).submit(None, lambda: done.append(1))
    assert done == [1]
    with pytest.raises(ValueError, match="max_outstanding"):
        InFlightQueue(-1)
