"""Hostfiles and resource filters: which hosts run ranks, and on which slots.

Pure functions over text and plain data, so every case is a table row in a test:

- ``parse_hostfile(text)`` reads DeepSpeed's MPI-style hostfile (``host slots=N`` per line,
  ``#`` comments and blank lines skipped) into an ordered ``{host: num_slots}``.
- ``parse_node_spec("h1:0,1@h2")`` reads an ``--include`` / ``--exclude`` value into
  ``{host: [slots]}`` (an empty list meaning "every slot of that host").
- ``active_resources(...)`` applies ``--include`` / ``--exclude`` / ``--num_nodes`` /
  ``--num_gpus`` to the hostfile and returns the ordered ``{host: [slot ids]}`` the job runs on.

The order of hosts is the hostfile's order; it fixes node ranks and therefore global ranks.
Every user mistake is a ``ValueError`` naming the file and line, or the host and slot.
"""

from __future__ import annotations

import base64
import json
import os
import re

__all__ = [
    "DEFAULT_HOSTFILE",
    "active_resources",
    "decode_world_info",
    "encode_world_info",
    "fetch_hostfile",
    "parse_hostfile",
    "parse_node_spec",
]

DEFAULT_HOSTFILE = "/job/hostfile"

_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")
_HOST = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+$")


def parse_hostfile(text: str, path: str = "<hostfile>") -> dict[str, int]:
    """``{host: num_slots}`` in file order. Errors name ``path:line`` and the offending text."""
    hosts: dict[str, int] = {}
    for line_no, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if match is None:
            raise ValueError(f"{path}:{line_no}: bad hostfile entry {raw.strip()!r}; "
                             "expected 'hostname slots=N'")
        host, num_slots = match.group(1), int(match.group(2))
        if num_slots < 1:
            raise ValueError(f"{path}:{line_no}: host {host!r} has slots={num_slots}; need at least 1")
        if host in hosts:
            raise ValueError(f"{path}:{line_no}: hostfile contains multiple entries for {host!r}")
        hosts[host] = num_slots
    if not hosts:
        raise ValueError(f"{path}: hostfile is empty or not formatted correctly")
    return hosts


def fetch_hostfile(path: str) -> dict[str, int] | None:
    """The parsed hostfile at ``path``, or None when there is no such file (local resources)."""
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return parse_hostfile(f.read(), path)


def parse_node_spec(spec: str, flag: str = "--include") -> dict[str, list[int]]:
    """``"h1:0,2@h2"`` -> ``{"h1": [0, 2], "h2": []}``; ``[]`` means every slot of the host."""
    nodes: dict[str, list[int]] = {}
    for part in spec.split("@"):
        part = part.strip()
        if not part:
            raise ValueError(f"{flag} {spec!r}: empty node entry (stray '@')")
        host, sep, slot_text = part.partition(":")
        if not _HOST.match(host):
            raise ValueError(f"{flag} {spec!r}: bad host name {host!r}")
        slots: list[int] = []
        if sep:
            for item in slot_text.split(","):
                if not item.strip().isdigit():
                    raise ValueError(f"{flag} {spec!r}: bad slot {item!r} for host {host!r}")
                slots.append(int(item))
            if len(set(slots)) != len(slots):
                raise ValueError(f"{flag} {spec!r}: host {host!r} lists a slot twice")
        if host in nodes:
            raise ValueError(f"{flag} {spec!r}: host {host!r} appears twice")
        nodes[host] = slots
    return nodes


def _check_known(hosts: dict[str, int], spec: dict[str, list[int]], flag: str) -> None:
    for host, slots in spec.items():
        if host not in hosts:
            raise ValueError(f"{flag}: unknown host {host!r}; known hosts: {', '.join(hosts)}")
        for slot in slots:
            if slot >= hosts[host]:
                raise ValueError(f"{flag}: host {host!r} has no slot {slot} "
                                 f"(it has slots 0..{hosts[host] - 1})")


def active_resources(hosts: dict[str, int], include: str = "", exclude: str = "",
                     num_nodes: int = -1, num_gpus: int = -1) -> dict[str, list[int]]:
    """The ordered ``{host: [slot ids]}`` the job runs on (DeepSpeed's ``active_resources``)."""
    if include and exclude:
        raise ValueError("--include and --exclude are mutually exclusive")
    if (include or exclude) and (num_nodes > 0 or num_gpus > 0):
        raise ValueError("--num_nodes / --num_gpus cannot be combined with --include / --exclude")
    resources = {host: list(range(n)) for host, n in hosts.items()}
    if include:
        spec = parse_node_spec(include, "--include")
        _check_known(hosts, spec, "--include")
        resources = {h: (spec[h] or slots) for h, slots in resources.items() if h in spec}
    elif exclude:
        spec = parse_node_spec(exclude, "--exclude")
        _check_known(hosts, spec, "--exclude")
        for host, slots in spec.items():
            drop = set(slots) if slots else set(resources[host])
            resources[host] = [s for s in resources[host] if s not in drop]
        resources = {h: slots for h, slots in resources.items() if slots}
    if num_nodes > 0:
        if num_nodes > len(resources):
            raise ValueError(f"--num_nodes {num_nodes}: only {len(resources)} hosts available")
        resources = dict(list(resources.items())[:num_nodes])
    if num_gpus > 0:
        for host, n in hosts.items():
            if host in resources and num_gpus > n:
                raise ValueError(f"--num_gpus {num_gpus}: host {host!r} has only {n} slots")
        resources = {h: list(range(num_gpus)) for h in resources}
    if not resources:
        raise ValueError("no hosts or slots left to run on after --include / --exclude")
    return resources


def encode_world_info(resources: dict[str, list[int]]) -> str:
    """DeepSpeed's ``--world_info``: urlsafe base64 of the JSON ``{host: [slots]}``."""
    return base64.urlsafe_b64encode(json.dumps(resources).encode()).decode()


def decode_world_info(text: str) -> dict[str, list[int]]:
    return json.loads(base64.urlsafe_b64decode(text.encode()).decode())
