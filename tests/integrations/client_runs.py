"""Launch a client-library script under real DeepSpeed and under zerospeed (through the alias).

Not `tests/distributed.py` nor tests/compat's harness: what is under test here includes the
launchers themselves (`deepspeed`, `accelerate launch`, torchrun) and the import of `deepspeed`
by transformers / accelerate in fresh processes, so each run is a launcher command in a
subprocess. Both sides get the same environment except PYTHONPATH: the zerospeed side has the
alias directory first (so `import deepspeed` gives zerospeed), the reference side only
`reference_site/` (an exit teardown, no package: it gets the venv's DeepSpeed 0.19.8). Everything is offline: tiny tokenizer and data written here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from deepspeed_extensions import clear_stale_locks, deepspeed_env, prepare_deepspeed_ops

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
ALIAS_SOURCE = os.path.join(REPO_ROOT, "integrations", "deepspeed-alias")
REFERENCE_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference_site")
BIN = os.path.dirname(sys.executable)

__all__ = ["ALIAS_SOURCE", "BIN", "REPO_ROOT", "SCRIPTS", "build_alias", "client_env", "free_port", "make_assets",
           "run"]


def free_port() -> int:
    """A port for one launch's rendezvous: launches run two at a time, never on a shared default."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_alias(target: str) -> str:
    """`pip install --target` of the alias distribution (no index, no dependencies, no isolation)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", target, ALIAS_SOURCE], check=True)
    return target


def client_env(alias: str | None) -> dict[str, str]:
    """Environment of one side: `alias` is the alias directory (zerospeed) or None (DeepSpeed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZS_", "DS_", "ACCELERATE_"))}
    # the reference side gets the gloo exit teardown DeepSpeed lacks (reference_site/sitecustomize.py)
    paths = [alias, REPO_ROOT] if alias else [REFERENCE_SITE]
    env.update(deepspeed_env())
    env.update(PYTHONPATH=os.pathsep.join(paths), ZS_ACCELERATOR="cpu",
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", WANDB_DISABLED="true", PYTHONWARNINGS="ignore",
               CUDA_VISIBLE_DEVICES="")  # ACCELERATE_* stripped above: ACCELERATE_USE_CPU would mean DDP
    env["PATH"] = os.pathsep.join(p for p in ([os.path.join(alias, "bin")] if alias else []) + [BIN, env.get("PATH", "")])
    return env


def run(cmd: list[str], alias: str | None, cwd: str, timeout_s: float = 600.0) -> str:
    """Run a launcher command; on failure raise with its output (the last 6000 characters).

    The launcher gets a session of its own, so that a timeout kills its ranks too (killing only
    the launcher would leave them running, holding ports, CPU and perhaps an op's build lock)."""
    if alias is None:
        prepare_deepspeed_ops()
    proc = subprocess.Popen(cmd, cwd=cwd, env=client_env(alias), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        _wait_until_gone(proc.pid)   # a dying rank still holds its build lock
        clear_stale_locks()
        raise AssertionError(f"{_side(alias)}: {' '.join(cmd)} ran over {timeout_s:.0f} s:\n{output[-6000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"{_side(alias)}: {' '.join(cmd)} exited {proc.returncode}:\n{output[-6000:]}")
    return output


def _wait_until_gone(pgid: int, timeout_s: float = 10.0) -> None:
    """Until no process of the killed group `pgid` is left (or `timeout_s` has passed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def _side(alias: str | None) -> str:
    return "zerospeed" if alias else "DeepSpeed"


def make_assets(root: str) -> dict[str, str]:
    """A word-level tokenizer, a text file and a tiny Llama checkpoint, all local."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(90)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", pad_token="</s>")
    paths = {"tokenizer": os.path.join(root, "tokenizer"), "text": os.path.join(root, "train.txt"),
             "model": os.path.join(root, "tiny-llama"), "jsonl": os.path.join(root, "train.jsonl")}
    tokenizer.save_pretrained(paths["tokenizer"])
    lines = [" ".join(words[(7 * i + 3 * j) % len(words)] for j in range(11 + i % 5)) for i in range(48)]
    with open(paths["text"], "w") as handle:
        handle.write("\n".join(lines) + "\n")
    with open(paths["jsonl"], "w") as handle:
        handle.writelines(json.dumps({"text": line}) + "\n" for line in lines)
    import torch

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    return paths


def read_json(path: str) -> dict:
    with open(path) as handle:
        return json.load(handle)
