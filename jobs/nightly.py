"""Nightly regression: `ray job submit --working-dir . -- python -m jobs.nightly --config configs/nightly.yaml`.

Runs the config on the cluster the job was submitted to, gates it with the config's rules and writes the
report; the exit code (the job's status) is the gate's.
"""

import argparse
import sys

from pipeline.cli import run_config
from pipeline.names import NIGHTLY

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/nightly.yaml")
    parser.add_argument("--run-id", help="resume this run")
    parser.add_argument("--archive", help="archive root shared by the cluster (default: the config's)")
    args = parser.parse_args()
    sys.exit(run_config(args.config, args.run_id, args.archive, kind=NIGHTLY))
