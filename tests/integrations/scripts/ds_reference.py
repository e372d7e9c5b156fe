"""Reference side only (real DeepSpeed 0.19.8 on CPU): run the given script unchanged, with
`deepspeed.comm` set up as soon as torch.distributed is. With `--use_cpu`, accelerate initializes
torch.distributed itself and never calls `deepspeed.init_distributed`, so DeepSpeed's `zero.Init`
(inside `from_pretrained`) sizes the batch with a world size of 1 and fails; on GPUs accelerate
initializes deepspeed.comm first. zerospeed reads torch.distributed directly and needs no wrapper."""

import runpy
import sys

import torch.distributed

import deepspeed

_init_process_group = torch.distributed.init_process_group


def init_process_group(*args, **kwargs):
    _init_process_group(*args, **kwargs)
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the group just made


torch.distributed.init_process_group = init_process_group
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
