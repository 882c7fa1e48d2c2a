"""A Ray cluster of three nodes on this machine (`ray.cluster_utils.Cluster`: a raylet and object store each, one
CPU and one `eval_slot` each, so that the three actors land one per node) writing one archive in the S3 server:
the CI config submitted with `ray job submit` through the nightly entry point, a killed driver's rerun, a node
removed mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import ray
import yaml
from ray.cluster_utils import Cluster
from ray.util.state import list_actors, list_tasks
from s3_server import free_ports

from pipeline.archive import ArchiveWriter
from pipeline.cli import main
from pipeline.config import load_config
from pipeline.runner import run
from pipeline.store import Store

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
NODE = dict(num_cpus=1, resources={"eval_slot": 1}, object_store_memory=80 * 2**20)
RAY_SECTION = dict(num_actors=3, resources={"eval_slot": 1}, shard_size=1)
GSM8K = {"gsm8k": {"num_fewshot": 1, "max_new_tokens": 32}}
CACHES = ("fp16", "kivi-k2v2-g32-r128")


@pytest.fixture(scope="module")
def cluster(s3_server, tmp_path_factory):
    """Head (with the dashboard, for jobs and the state API) and two worker nodes; this process is its driver."""
    ray.shutdown()  # a Ray client of another test's cluster
    # Ray writes the cluster's address to $RAY_TMPDIR/ray/ray_current_cluster whatever the nodes' temp_dir, and makes
    # that folder only for a node started there: on a machine where no Ray ever ran, the head would fail to start.
    ray_tmpdir = tmp_path_factory.mktemp("ray-tmpdir")
    (ray_tmpdir / "ray").mkdir()
    env = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": str(ray_tmpdir),
           # Nodes run this interpreter's environment: a submitted job's `python` is this one.
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           # Task states reach the state API within 0.1 s (default 1 s): the node-loss test sees what runs now.
           "RAY_task_events_report_interval_ms": "100"}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        # The head's job agent on a free port, not Ray's fixed default: a port another Ray on this machine holds
        # leaves the head without an agent, and every submission is refused.
        dashboard, agent = free_ports(2)
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            NODE, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=dashboard,
            dashboard_agent_listen_port=agent,
            temp_dir=str(tmp_path_factory.mktemp("ray"))))
        for _ in range(2):
            cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        cluster.connect()
        cluster.dashboard = f"http://127.0.0.1:{dashboard}"
        try:
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()


def s3_config(tmp_path: Path, s3_server, cluster, workloads: dict, **fields) -> tuple[Path, str]:
    """A config file over ``workloads`` with a fresh prefix of the S3 bucket as its archive; (path, archive URI)."""
    archive = f"s3://{s3_server.bucket}/multinode-{uuid.uuid4().hex[:8]}"
    config = dict(kind="smoke", model={"spec": "smollm2-135m", "max_context": 1024}, caches=["kivi-2"],
                  workloads=workloads, archive=archive, reports=str(tmp_path / "reports"),
                  ray=dict(RAY_SECTION, address=cluster.address), generation={"batch_size": 2}, **fields)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, archive


def submit_job(cluster, entrypoint: list[str]) -> subprocess.CompletedProcess:
    """`ray job submit` to the cluster; resubmitted while the head's job agent is still starting (a loaded
    machine takes longer than `wait_for_nodes` to bring it up)."""
    for _ in range(30):
        job = subprocess.run(
            [str(Path(sys.executable).with_name("ray")), "job", "submit", "--address", cluster.dashboard,
             "--working-dir", str(REPO_ROOT), "--", *entrypoint], capture_output=True, text=True, timeout=1200)
        if "No available agent to submit job" not in job.stdout + job.stderr:
            return job
        time.sleep(2)
    return job


def results_keys(archive: str, run_id: str) -> list[tuple]:
    with Store(archive) as store:
        return store.query("SELECT workload, task, request_id, cache FROM results WHERE run_id = $1", [run_id])[1]


def assert_complete_once(archive: str, run_id: str, requests: int) -> None:
    """Every request under every cache exactly once, and one file per shard × cache (shards of one request)."""
    keys = results_keys(archive, run_id)
    assert len(keys) == len(set(keys)) == requests * len(CACHES)
    files = ArchiveWriter(archive, run_id).root.glob(f"results/run_id={run_id}/*/*/*.parquet")
    assert len(files) == requests * len(CACHES)


def test_the_nightly_job_on_three_nodes_writes_every_shard_and_cache_once_to_s3(cluster, s3_server, data_dir, tmp_path,
                                                                                 capsys):
    ci = yaml.safe_load((REPO_ROOT / "configs/ci.yaml").read_text())
    path, archive = s3_config(tmp_path, s3_server, cluster, ci["workloads"], data_dir=str(data_dir),
                              sweep=ci["sweep"], gate=str(REPO_ROOT / "configs/gates/ci.yaml"))
    job = submit_job(cluster, ["python", "-m", "jobs.nightly", "--config", str(path), "--run-id", "nightly-3n"])
    assert "succeeded" in job.stdout, job.stdout[-3000:] + job.stderr[-3000:]

    assert_complete_once(archive, "nightly-3n", requests=7)  # gsm8k 2, longbench 2, niah 2, fidelity 1
    with Store(archive) as store:
        (status, kind, placements), = store.query("SELECT status, kind, placements FROM runs WHERE run_id = 'nightly-3n'")[1]
        sweeps = store.query("SELECT DISTINCT cache FROM perf WHERE run_id = 'nightly-3n' ORDER BY cache")[1]
        (errors,), = store.query("SELECT count(error) FROM results WHERE run_id = 'nightly-3n'")[1]
    placements = json.loads(placements)
    assert (status, kind, errors) == ("complete", "nightly", 0) and sweeps == [(c,) for c in CACHES]
    assert len({p["node_id"] for p in placements}) == 3 and all(p["jobs"] >= 1 for p in placements)
    assert sum(p["jobs"] for p in placements) == 7 + 2  # shards and sweeps

    # The archive commands read the S3 archive: the job's verdicts, then a gate run again from here.
    capsys.readouterr()
    assert main(["query", "SELECT rule, passed FROM verdicts WHERE run_id = 'nightly-3n'", "--archive", archive]) == 0
    assert "| fidelity-kivi2 | True" in capsys.readouterr().out
    assert main(["gate", "nightly-3n", "--rules", str(REPO_ROOT / "configs/gates/ci.yaml"), "--archive", archive]) == 0
    assert "on nightly-3n: PASSED" in capsys.readouterr().out
    assert (tmp_path / "reports/nightly-3n/report.md").is_file()


def test_a_killed_drivers_rerun_computes_only_the_missing_files(cluster, s3_server, data_dir, tmp_path):
    path, archive = s3_config(tmp_path, s3_server, cluster, {"gsm8k": {**GSM8K["gsm8k"], "n": 4}},
                              data_dir=str(data_dir))
    root = ArchiveWriter(archive, "killed").root
    driver = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", str(path), "--run-id", "killed"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while len(root.glob("results/run_id=killed/*/*/*.parquet")) < 2 and time.time() < deadline and driver.poll() is None:
        time.sleep(0.5)
    os.killpg(driver.pid, signal.SIGKILL)  # the driver dies: no cleanup, no status update
    driver.wait()
    while any(a.class_name == "EvalWorker" for a in list_actors(filters=[("state", "=", "ALIVE")])):
        time.sleep(0.5)  # Ray ends the dead driver's actors: none may write behind the count below
    done = len(root.glob("results/run_id=killed/*/*/*.parquet"))
    assert 0 < done < 8, f"killed after {done} of 8 files"

    resumed = run(load_config(path), path.read_text(), run_id="killed", progress=False)
    assert resumed.reused == done and len(resumed.computed) == 8 - done
    assert_complete_once(archive, "killed", requests=4)


def test_a_node_removed_mid_run_has_its_shards_retried_on_the_others(cluster, s3_server, data_dir, tmp_path):
    # Longer answers than the other tests' keep a shard running for seconds after it is seen to start.
    path, archive = s3_config(tmp_path, s3_server, cluster, {"gsm8k": {**GSM8K["gsm8k"], "n": 9, "max_new_tokens": 64}},
                              data_dir=str(data_dir))
    config = load_config(path)
    outcome = {}
    driver = threading.Thread(target=lambda: outcome.update(summary=run(config, path.read_text(), run_id="lost-node",
                                                                        progress=False)))
    driver.start()
    workers = {node.node_id: node for node in cluster.worker_nodes}
    removed = None
    while removed is None and driver.is_alive():  # a shard just started on a worker node: its node goes
        running = list_tasks(filters=[("name", "=", "EvalWorker.run_shard"), ("state", "=", "RUNNING")], detail=True)
        now_ms = time.time() * 1000
        removed = next((t.node_id for t in running if t.node_id in workers and now_ms - t.start_time_ms < 500), None)
        time.sleep(0.1)
    assert removed is not None, "no shard ran on a worker node"
    cluster.remove_node(workers[removed])
    driver.join(timeout=900)
    summary = outcome["summary"]  # the run finished on the two nodes left

    assert_complete_once(archive, "lost-node", requests=9)
    # The actor of the removed node lost its job; where Ray found room it was restarted, on another node, and its
    # placement now names that node.
    assert [p["lost_jobs"] for p in summary.placements if p["lost_jobs"]] == [1]
    assert sum(p["jobs"] for p in summary.placements) == 9  # each job counted once, where it finished
    assert ArchiveWriter(archive, "lost-node").read_run()["status"] == "complete"
    cluster.add_node(**NODE)  # three nodes again for whatever runs next
