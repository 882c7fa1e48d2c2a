"""Canary before a model or kernel upgrade: the candidate run is gated against an archived baseline run.

    ray job submit --working-dir . -- python -m jobs.canary --config configs/canary.yaml --baseline RUN_ID

Exit code 0 only if every rule passes, the `no_regression_vs_baseline` rules included.
"""

import argparse
import sys

from pipeline.cli import run_config
from pipeline.names import CANARY

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/canary.yaml")
    parser.add_argument("--baseline", required=True, help="run_id of the archived baseline run")
    parser.add_argument("--run-id", help="resume this run")
    parser.add_argument("--archive", help="archive root shared by the cluster (default: the config's)")
    args = parser.parse_args()
    sys.exit(run_config(args.config, args.run_id, args.archive, kind=CANARY, baseline_run_id=args.baseline))
