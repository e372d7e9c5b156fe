"""Formatting for the flops profiler: unit strings, the summary, the aggregated and the tree views."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

__all__ = ["ModuleProfile", "number_to_string", "flops_to_string", "macs_to_string", "params_to_string",
           "duration_to_string", "format_tree", "format_aggregated"]


@dataclasses.dataclass
class ModuleProfile:
    """What one module cost during the profiled forward passes (parents include their children)."""

    name: str            # qualified name in the model ("" for the root)
    class_name: str
    depth: int           # 0 for the root
    params: int
    flops: int = 0
    macs: int = 0
    latency_s: float = 0.0
    children: list[ModuleProfile] = dataclasses.field(default_factory=list)


_PREFIXES = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")]


def number_to_string(value: float, units: str | None = None, precision: int = 2) -> str:
    """`1.23 G`-style; `units` forces a prefix ("G", "M", "K", "" ...)."""
    if units is not None:
        scale = dict((prefix, factor) for factor, prefix in _PREFIXES).get(units, 1.0)
        return f"{value / scale:.{precision}f} {units}"
    for factor, prefix in _PREFIXES:
        if abs(value) >= factor:
            return f"{value / factor:.{precision}f} {prefix}"
    return f"{value:.{precision}f} "


def flops_to_string(flops: float, units: str | None = None, precision: int = 2) -> str:
    return number_to_string(flops, units, precision) + "FLOPS"


def macs_to_string(macs: float, units: str | None = None, precision: int = 2) -> str:
    return number_to_string(macs, units, precision) + "MACs"


def params_to_string(params: float, units: str | None = None, precision: int = 2) -> str:
    return number_to_string(params, units, precision).rstrip()


def duration_to_string(seconds: float, precision: int = 2) -> str:
    if seconds >= 1.0:
        return f"{seconds:.{precision}f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.{precision}f} ms"
    return f"{seconds * 1e6:.{precision}f} us"


def _percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.2f}%" if whole else "0.00%"


def _describe(profile: ModuleProfile, root: ModuleProfile) -> str:
    rate = profile.flops / profile.latency_s if profile.latency_s > 0 else 0.0
    return ", ".join([
        f"{params_to_string(profile.params)} = {_percent(profile.params, root.params)} Params",
        f"{macs_to_string(profile.macs)} = {_percent(profile.macs, root.macs)} MACs",
        f"{duration_to_string(profile.latency_s)} = {_percent(profile.latency_s, root.latency_s)} latency",
        f"{flops_to_string(rate)}",
    ])


def format_tree(root: ModuleProfile, module_depth: int = -1) -> str:
    """One line per module, indented by depth: params, MACs and latency with their shares, FLOP/s."""
    lines: list[str] = []

    def visit(profile: ModuleProfile) -> None:
        if module_depth != -1 and profile.depth > module_depth:
            return
        label = f"({profile.name.rsplit('.', 1)[-1]}): " if profile.name else ""
        lines.append("  " * profile.depth + f"{label}{profile.class_name}({_describe(profile, root)})")
        for child in profile.children:
            visit(child)

    visit(root)
    return "\n".join(lines)


def _by_depth(root: ModuleProfile) -> dict[int, dict[str, list[float]]]:
    """depth -> class name -> [params, macs, latency_s] summed over that depth's modules."""
    table: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0.0]))
    stack = [root]
    while stack:
        profile = stack.pop()
        row = table[profile.depth][profile.class_name]
        row[0] += profile.params
        row[1] += profile.macs
        row[2] += profile.latency_s
        stack.extend(profile.children)
    return table


def format_aggregated(root: ModuleProfile, module_depth: int = -1, top_modules: int = 1) -> str:
    """Per depth, the `top_modules` module classes by params, by MACs and by latency."""
    table = _by_depth(root)
    depths = sorted(table) if module_depth == -1 else [d for d in sorted(table) if d <= module_depth]
    lines = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for depth in depths:
        rows = table[depth]

        def top(index: int, fmt, rows=rows) -> dict[str, str]:  # rows bound now: top() runs in this iteration
            ranked = sorted(rows.items(), key=lambda item: item[1][index], reverse=True)[:top_modules]
            return {name: fmt(values[index]) for name, values in ranked}

        lines.append(f"depth {depth}:")
        lines.append(f"    params      - {top(0, params_to_string)}")
        lines.append(f"    MACs        - {top(1, macs_to_string)}")
        lines.append(f"    fwd latency - {top(2, duration_to_string)}")
    return "\n".join(lines)
