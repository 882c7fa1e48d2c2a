"""Pipeline fixtures: config files written per test, and a Ray head node started like a real cluster."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, LlamaConfig

RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def write_config(tmp_path):
    """write_config(**fields) -> path of a YAML run config (archive under tmp_path unless given)."""

    def write(name: str = "run.yaml", **fields) -> Path:
        fields.setdefault("archive", str(tmp_path / "archive"))
        path = tmp_path / name
        path.write_text(yaml.safe_dump(fields, sort_keys=False))
        return path

    return write


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """`ray start --head` on free ports (dashboard included, for job submission); yields (gcs, dashboard) addresses."""
    port, dash = free_port(), free_port()
    temp = tmp_path_factory.mktemp("ray")
    # A loopback-only test cluster: no token auth between this test process, the head and the job it submits.
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # The cluster runs this interpreter's environment, as when started from an activated virtualenv: a
    # submitted job's `python` is this one.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    subprocess.run([RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2", "--num-gpus=0",
                    "--include-dashboard=true", f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1",
                    f"--temp-dir={temp}", "--disable-usage-stats"], check=True, env=env, capture_output=True)
    try:
        yield f"127.0.0.1:{port}", f"http://127.0.0.1:{dash}"
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True)
        time.sleep(1)


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory):
    """tiny_model_folder(head_dim, vocab_size=None) -> a saved random 2-layer Llama (1 KV head) with SmolLM2's
    tokenizer; a vocabulary smaller than the tokenizer's (its ids fold into it) makes every step cheaper."""
    from pipeline.models import load_tokenizer

    def make(head_dim: int, vocab_size: int | None = None) -> Path:
        folder = tmp_path_factory.mktemp(f"tiny-llama-d{head_dim}-v{vocab_size}")
        tokenizer = load_tokenizer("smollm2-135m")
        config = LlamaConfig(hidden_size=2 * head_dim, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=vocab_size or len(tokenizer),
                             eos_token_id=tokenizer.eos_token_id)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return folder

    return make
