"""Run one library's checkpoint converter over many jobs in one interpreter (DeepSpeed's import is slow).

    python convert_runner.py <deepspeed|zerospeed> <jobs.json>

Each job: {"checkpoint_dir", "output_dir", "dtype", "safe_serialization"}; the library's
`utils.zero_to_fp32.convert_zero_checkpoint_to_state_dict`. A job that raises writes its
exception type name into `<output_dir>/error.txt`, so the other jobs still run.
"""

import importlib
import json
import os
import sys


def main(impl: str, jobs_path: str) -> None:
    converter = importlib.import_module(f"{impl}.utils.zero_to_fp32")
    with open(jobs_path) as handle:
        jobs = json.load(handle)
    for job in jobs:
        os.makedirs(job["output_dir"], exist_ok=True)
        try:
            converter.convert_zero_checkpoint_to_state_dict(
                job["checkpoint_dir"], job["output_dir"], dtype=job["dtype"],
                safe_serialization=job["safe_serialization"])
        except Exception as error:  # noqa: BLE001 - the type is the result
            with open(os.path.join(job["output_dir"], "error.txt"), "w") as handle:
                handle.write(type(error).__name__)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
