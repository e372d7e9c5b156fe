"""Compat script: the top-level ds_config keys a library's `DeepSpeedConfig` looks up.

The config is a dict that records every key asked for (`get`, `[]`, `in`, `in .keys()`), so the
list comes from the library's own config code rather than from reading it.
"""

from __future__ import annotations

from collections.abc import Iterator, KeysView
from typing import Any


class _RecordingKeys(KeysView):
    def __init__(self, owner: _Recorder) -> None:
        super().__init__(owner)
        self._owner = owner

    def __contains__(self, key: object) -> bool:
        return self._owner.__contains__(key)


class _Recorder(dict):
    seen: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        _Recorder.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        _Recorder.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        _Recorder.seen.add(key)  # type: ignore[arg-type]
        return super().__contains__(key)

    def keys(self) -> _RecordingKeys:  # type: ignore[override]
        return _RecordingKeys(self)

    def __iter__(self) -> Iterator[Any]:
        return super().__iter__()


def main(ds, ctx) -> dict:
    config_module = ctx.submodule("runtime.config")
    config_module.DeepSpeedConfig(_Recorder({"train_batch_size": 1}))
    return {"keys": sorted(str(key) for key in _Recorder.seen)}
