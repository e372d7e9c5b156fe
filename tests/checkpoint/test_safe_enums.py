"""Enum members pickled by name load through every weights-only loader; any other getattr is refused.

Some Pythons (Debian 12's 3.11.2) pickle an Enum member as `getattr(EnumClass, "name")`, others by
value, so DeepSpeed's optim files differ by the interpreter that wrote them (issue 32). These tests
write the by-name form opcode by opcode (GLOBAL builtins getattr, GLOBAL the class, the name,
TUPLE2, REDUCE) into a real torch.save zip, so they exercise it whatever Python runs them, and
load it through the package's loaders (manifest.load_file, safe_enums.load_deepspeed_file)
and the standalone zero_to_fp32.py.
"""

import os
import pickle
import shutil
import struct
import subprocess
import sys
import types
import zipfile

import pytest
import torch
from torch.amp.grad_scaler import OptState

from distributed import run_on_ranks
from test_deepspeed_interop import FIXTURES, STEPS, _load_and_resave

from zerospeed.checkpoint.deepspeed_compat import DEEPSPEED_GLOBALS, DeepSpeedZeroStage
from zerospeed.checkpoint.safe_enums import load_deepspeed_file
from zerospeed.checkpoint.layout import find_model_files
from zerospeed.checkpoint.manifest import load_file
from zerospeed.checkpoint.safe_enums import enum_globals, safe_enum_classes
from zerospeed.checkpoint.zero_checkpoint import discover, export_full_state
from zerospeed.runtime.zero.config import ZeroStageEnum
from zerospeed.utils import zero_to_fp32

ZERO_CONFIG = "deepspeed.runtime.zero.config"
OFFLOAD_CONFIG = "deepspeed.runtime.zero.offload_config"


class Ops(bytes):
    """Pickle opcodes written into the stream as they are, in place of an object."""


def _text(value: str) -> bytes:
    encoded = value.encode("utf-8")
    return pickle.BINUNICODE + struct.pack("<I", len(encoded)) + encoded


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode("ascii")


def getattr_ops(first: bytes, name: bytes, builtins_module: str = "__builtin__") -> Ops:
    """`getattr(first, name)` as pickle writes an Enum member by name (protocol 2 spells the
    module `__builtin__`, protocol 3+ `builtins`)."""
    return Ops(_global(builtins_module, "getattr") + first + name + pickle.TUPLE2 + pickle.REDUCE)


_DEEPSPEED_PATH_OF = {cls: path for cls, path in DEEPSPEED_GLOBALS}


class _CraftingPickler(pickle._Pickler):  # type: ignore[name-defined]
    """Writes `Ops` verbatim, DeepSpeed's stand-ins under DeepSpeed's class paths, and ZeroStageEnum
    members by name, as DeepSpeed does under Python 3.11.2."""

    def save(self, obj, save_persistent_id=True):
        if type(obj) is Ops:
            self.write(obj)
            return
        if type(obj) is DeepSpeedZeroStage:
            self.write(getattr_ops(_global(ZERO_CONFIG, "ZeroStageEnum"), _text(ZeroStageEnum(int(obj)).name)))
            return
        super().save(obj, save_persistent_id)

    def save_global(self, obj, name=None):
        path = _DEEPSPEED_PATH_OF.get(obj)
        if path is None:
            return super().save_global(obj, name)
        module, _, qualname = path.rpartition(".")
        self.write(_global(module, qualname))
        self.memoize(obj)


_CRAFTING = types.ModuleType("crafting_pickle")
_CRAFTING.Pickler = _CraftingPickler  # type: ignore[attr-defined]


def _save(path, obj) -> str:
    with open(path, "wb") as handle:
        torch.save(obj, handle, pickle_module=_CRAFTING)
    return str(path)


def _globals_in(path) -> set[str]:
    import pickletools

    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    return {arg.replace(" ", ".") for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}


def _load_package(path):
    return load_file(path)


LOADERS = {"manifest.load_file": _load_package, "safe_enums.load_deepspeed_file": load_deepspeed_file,
           "zero_to_fp32 (standalone)": zero_to_fp32._load}

MEMBERS = [   # (module, class, member name, the value it loads as)
    (ZERO_CONFIG, "ZeroStageEnum", "gradients", 2),
    (ZERO_CONFIG, "ZeroStageEnum", "max_stage", 3),   # an alias: pickle writes the canonical name, accept both
    ("zerospeed.runtime.zero.config", "ZeroStageEnum", "weights", 3),
    (OFFLOAD_CONFIG, "OffloadDeviceEnum", "cpu", "cpu"),
    ("zerospeed.runtime.zero.offload.config", "OffloadDeviceEnum", "nvme", "nvme"),
    ("torch.amp.grad_scaler", "OptState", "STEPPED", OptState.STEPPED),
]


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("builtins_module", ["__builtin__", "builtins"])
@pytest.mark.parametrize("module,cls,name,value", MEMBERS, ids=lambda v: str(v) if isinstance(v, str) else None)
def test_enum_member_by_name_loads(tmp_path, loader, builtins_module, module, cls, name, value):
    ops = getattr_ops(_global(module, cls), _text(name), builtins_module)
    path = _save(tmp_path / "state.pt", {"weight": torch.arange(4.0), "value": ops, "after": [ops, 7]})
    assert "builtins.getattr" in {g.replace("__builtin__", "builtins") for g in _globals_in(path)}
    loaded = LOADERS[loader](path)
    assert loaded["value"] == value and loaded["after"] == [value, 7]
    assert torch.equal(loaded["weight"], torch.arange(4.0))


def test_enum_member_by_value_still_loads(tmp_path):
    path = _save(tmp_path / "state.pt", {"value": Ops(_global(OFFLOAD_CONFIG, "OffloadDeviceEnum") + _text("cpu")
                                                      + pickle.TUPLE1 + pickle.REDUCE)})
    for loader in LOADERS.values():
        assert loader(path)["value"] == "cpu"


def _call(ops: bytes, argument: str) -> Ops:
    return Ops(ops + _text(argument) + pickle.TUPLE1 + pickle.REDUCE)


_OS = _global("posixpath", "os")   # the os module, reached as an attribute of posixpath
_STAGE = _global(ZERO_CONFIG, "ZeroStageEnum")

MALICIOUS = {   # each takes the path of a file that must not appear
    "getattr(os, 'system')": lambda marker: _call(getattr_ops(_OS, _text("system")), f"touch {marker}"),
    "getattr(os, 'system') via the builtins spelling": lambda marker: _call(
        getattr_ops(_OS, _text("system"), "builtins"), f"touch {marker}"),
    # allowlisted classes that are not enums: torch's own and DeepSpeed's stand-in
    "getattr(OrderedDict, 'fromkeys')": lambda _: _call(
        getattr_ops(_global("collections", "OrderedDict"), _text("fromkeys")), "ab"),
    "getattr(LossScaler, '__init__')": lambda _: getattr_ops(
        _global("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), _text("__init__")),
    # a builtin allowlisted by torch, a plain string
    "getattr(set, '__subclasses__')": lambda _: getattr_ops(_global("builtins", "set"), _text("__subclasses__")),
    "getattr('text', 'format')": lambda _: getattr_ops(_text("text"), _text("format")),
    # an allowlisted enum, but not a member name
    "getattr(ZeroStageEnum, '__class__')": lambda _: getattr_ops(_STAGE, _text("__class__")),
    "getattr(ZeroStageEnum, '_missing_')": lambda _: getattr_ops(_STAGE, _text("_missing_")),
    "getattr(ZeroStageEnum, 2)": lambda _: getattr_ops(_STAGE, pickle.BININT1 + bytes([2])),
    # an enum outside the allowlist
    "getattr(ZeroParamStatus, 'AVAILABLE')": lambda _: getattr_ops(
        _global("zerospeed.runtime.zero.param_state", "ZeroParamStatus"), _text("AVAILABLE")),
}
REFUSED_AS_GLOBAL = {"getattr(os, 'system')", "getattr(os, 'system') via the builtins spelling",
                     "getattr(ZeroParamStatus, 'AVAILABLE')"}


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("case", MALICIOUS)
def test_any_other_getattr_is_refused(tmp_path, monkeypatch, loader, case):
    monkeypatch.delenv("ZEROSPEED_CHECKPOINT_ALLOW_PICKLE", raising=False)
    marker = tmp_path / "pwned"
    ops = MALICIOUS[case](marker)
    path = _save(tmp_path / "state.pt", {"weight": torch.zeros(2), "value": ops})
    expected = {"manifest.load_file": (ValueError, "needs arbitrary unpickling"),
                "safe_enums.load_deepspeed_file": (pickle.UnpicklingError, "Weights only load failed"),
                "zero_to_fp32 (standalone)": (ValueError, "needs unpickling")}[loader]
    with pytest.raises(expected[0], match=expected[1]) as refused:
        LOADERS[loader](path)
    # refused by the getattr check, or earlier, by torch, for a global outside the allowlist
    reason = "Unsupported global" if case in REFUSED_AS_GLOBAL else "refusing getattr("
    assert reason in str(refused.value)
    assert not marker.exists()


def test_standalone_copy_allows_the_same_enum_members():
    """zero_to_fp32.py cannot import safe_enums.py: its table must name the same paths and members."""
    package = {path: {n: m.value for n, m in safe_enum_classes()[cls].__members__.items()}
               for cls, path in [*enum_globals()[:-1], (DeepSpeedZeroStage, f"{ZERO_CONFIG}.ZeroStageEnum")]}
    standalone = {path: {n: getattr(v, "value", v) for n, v in zero_to_fp32._ENUM_MEMBERS[cls].items()}
                  for cls, path in zero_to_fp32._DEEPSPEED_GLOBALS if cls in zero_to_fp32._ENUM_MEMBERS}
    assert standalone == package


def _deepspeed_checkpoint_by_name(stage, tmp_path) -> str:
    """A copy of the DeepSpeed 0.19.8 fixture with ZeroStageEnum pickled by name, byte for byte
    the form DeepSpeed writes under Python 3.11.2."""
    copy = str(tmp_path / f"stage{stage}")
    shutil.copytree(os.path.join(FIXTURES, f"stage{stage}"), copy)
    tag_dir = os.path.join(copy, f"global_step{STEPS}")
    optim_files = [os.path.join(tag_dir, n) for n in sorted(os.listdir(tag_dir)) if n.endswith("optim_states.pt")]
    for path in optim_files:
        with torch.serialization.safe_globals(DEEPSPEED_GLOBALS):   # the stand-ins, kept as objects
            state = torch.load(path, weights_only=True)
        _save(path, state)
        assert {"builtins.getattr", f"{ZERO_CONFIG}.ZeroStageEnum"} <= {
            g.replace("__builtin__", "builtins") for g in _globals_in(path)}
    return copy


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_to_fp32_reads_deepspeed_checkpoint_with_enums_by_name(stage, tmp_path):
    checkpoint = _deepspeed_checkpoint_by_name(stage, tmp_path)
    expected = torch.load(os.path.join(checkpoint, "expected.pt"), weights_only=True)
    state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(checkpoint)
    assert state.keys() == expected.keys()
    for name, want in expected.items():
        assert torch.equal(state[name], want["fp32"]), name


def test_standalone_zero_to_fp32_script_reads_enums_by_name_without_zerospeed(tmp_path):
    """The copy written into checkpoints, run as a script with every zerospeed import failing."""
    checkpoint = _deepspeed_checkpoint_by_name(2, tmp_path)
    script = shutil.copy(zero_to_fp32.__file__, os.path.join(checkpoint, "zero_to_fp32.py"))
    block_and_run = ("import runpy, sys; sys.modules['zerospeed'] = None; "   # `import zerospeed...` raises
                     "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", block_and_run, script, checkpoint, str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    state = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    expected = torch.load(os.path.join(checkpoint, "expected.pt"), weights_only=True)
    assert state.keys() == expected.keys()
    for name, want in expected.items():
        assert torch.equal(state[name], want["fp32"]), name


@pytest.mark.parametrize("stage", [2, 3])
def test_engine_resumes_deepspeed_checkpoint_with_enums_by_name(stage, tmp_path):
    checkpoint = _deepspeed_checkpoint_by_name(stage, tmp_path)
    expected = torch.load(os.path.join(checkpoint, "expected.pt"), weights_only=True)
    run_on_ranks(_load_and_resave, 2, stage, checkpoint, str(tmp_path / "resaved"))
    tag_dir = str(tmp_path / "resaved" / f"global_step{STEPS}")
    full = export_full_state(discover(tag_dir, bf16_first=False), load_file(find_model_files(tag_dir)[0]))
    for name, want in expected.items():
        assert torch.equal(full.fp32[name], want["fp32"]), name
        assert torch.equal(full.moments[name]["exp_avg"], want["exp_avg"]), name
