"""One config on Ray clusters of 1 and of N nodes on this machine, CPU actors, one archive root:
``python -m tools.bench_multinode configs/smoke.yaml --archive s3://bucket/prefix --nodes 1 3``.

Each cluster is `ray.cluster_utils.Cluster` (a raylet and an object store per node), each node offering
``--cpus // nodes`` CPUs and one ``eval_slot``, so that one actor lands on each node. The run goes to
``<archive>/nodes-<N>``; printed (and written to ``--out``): wall time from the run's start to its manifest's
completion, and each actor's node, start-up seconds and jobs. On one machine the nodes share its cores: this
measures what the extra nodes cost and how jobs spread, not the speed-up of separate machines.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from pipeline.config import load_config
from pipeline.runner import run


def on_cluster(config_path: str, archive: str, nodes: int, cpus: int) -> dict:
    per_node = max(cpus // nodes, 1)
    node = dict(num_cpus=per_node, resources={"eval_slot": 1}, object_store_memory=80 * 2**20)
    cluster = Cluster(initialize_head=True, head_node_args=node)
    for _ in range(nodes - 1):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    cluster.connect()
    try:
        config = load_config(config_path, archive=f"{archive}/nodes-{nodes}")
        ray_section = config.ray.model_copy(update=dict(address=cluster.address, num_actors=nodes,
                                                         resources={"eval_slot": 1}, cpus_per_actor=per_node))
        config = config.model_copy(update={"ray": ray_section})
        began = time.perf_counter()
        summary = run(config, Path(config_path).read_text(), progress=False)
        wall = time.perf_counter() - began
    finally:
        ray.shutdown()
        cluster.shutdown()
    return dict(nodes=nodes, cpus_per_node=per_node, run_id=summary.run_id, wall_s=round(wall, 1),
                shard_cache_files=len(summary.computed), sweeps=len(summary.sweeps),
                actors=[{k: p[k] for k in ("node_id", "pid", "ready_s", "load_s", "jobs", "lost_jobs")}
                        for p in summary.placements])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--archive", required=True, help="archive root (a folder or a URI); runs go under nodes-<N>/")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--cpus", type=int, default=os.cpu_count(), help="logical CPUs shared by a cluster's nodes")
    parser.add_argument("--out", type=Path, help="also write the figures here as JSON")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip())
    out = dict(date=dt.date.today().isoformat(), commit=commit, dirty_tree=dirty, config=args.config,
               machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", cpus=args.cpus,
               runs=[on_cluster(args.config, args.archive, n, args.cpus) for n in args.nodes])
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
