"""Where data comes from: an unreachable Hub or a missing folder fails early with one clear message."""

import re

import pytest
from huggingface_hub import constants

from pipeline.workloads import DataSourceError, get_workload


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.mark.parametrize("name", ["gsm8k", "sharegpt"])
def test_without_data_dir_an_offline_hub_fails_before_any_request_naming_both_ways_out(offline, name):
    workload = get_workload(name)
    # No tokenizer: the error must come before anything is tokenized (or any model loaded).
    for call in (workload.check_data, lambda: workload.requests(None, 4096)):
        with pytest.raises(DataSourceError,
                           match=r"HF_HUB_OFFLINE is set.*point data_dir at a local copy .*\$KIVI_DATA_DIR"):
            call()


def test_longbench_without_data_dir_reads_templates_from_config_dir_then_needs_the_hub(offline, data_dir):
    workload = get_workload("longbench", config_dir=data_dir / "longbench" / "config")
    with pytest.raises(DataSourceError, match="dataset 'THUDM/LongBench'.*data_dir"):
        workload.check_data()


def test_an_unreachable_hub_names_the_dataset_and_the_options(monkeypatch):
    from huggingface_hub import HfApi

    def refuse(*args, **kwargs):
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(HfApi, "dataset_info", refuse)
    with pytest.raises(DataSourceError, match=r"cannot reach dataset 'openai/gsm8k'.*data_dir.*HF_HUB_OFFLINE"):
        get_workload("gsm8k").check_data()


@pytest.mark.parametrize("name", ["gsm8k", "longbench", "niah", "sharegpt"])
def test_a_missing_data_folder_is_named_by_every_workload(name, tmp_path):
    missing = tmp_path / "no-such-folder"
    with pytest.raises(DataSourceError, match=re.escape(f"data folder {missing} does not exist")):
        get_workload(name, data_dir=missing).check_data()
