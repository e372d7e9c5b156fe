"""Run one library's `checkpoint.ds_to_universal` over many conversions in one interpreter.

    python universal_runner.py <deepspeed|zerospeed> <jobs.json>

Each job: {"input_folder", "output_folder"}; converted with DeepSpeed's flags for a plain model
(`--inject_missing_state`) and one worker of each kind (no process pool), through the module's
own `main(args)`, as `python -m <impl>.checkpoint.ds_to_universal` runs it.
"""

import argparse
import importlib
import json
import sys


def main(impl: str, jobs_path: str) -> None:
    converter = importlib.import_module(f"{impl}.checkpoint.ds_to_universal")
    with open(jobs_path) as handle:
        jobs = json.load(handle)
    for job in jobs:
        converter.main(argparse.Namespace(input_folder=job["input_folder"], output_folder=job["output_folder"],
                                          num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                          strict=True, inject_missing_state=True))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
