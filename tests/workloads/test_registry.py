import pytest

from pipeline.workloads import (
    UnknownWorkloadError,
    Workload,
    WorkloadOptionError,
    get_workload,
    register_workload,
    workload_names,
)


def test_the_four_workloads_are_registered_under_their_names():
    assert workload_names() == ["fidelity", "gsm8k", "longbench", "niah", "sharegpt"]


def test_a_misspelt_workload_name_suggests_the_closest_one_and_lists_all():
    with pytest.raises(UnknownWorkloadError) as error:
        get_workload("gsm8")
    assert str(error.value) == (
        "Unknown workload 'gsm8' (did you mean 'gsm8k'?). Known: fidelity, gsm8k, longbench, niah, sharegpt"
    )


def test_an_unrelated_workload_name_lists_the_known_ones_without_a_guess():
    with pytest.raises(UnknownWorkloadError, match=r"^Unknown workload 'mmlu'\. Known: fidelity, gsm8k, longbench"):
        get_workload("mmlu")


def test_a_bad_option_value_names_the_workload_and_the_option(data_dir):
    with pytest.raises(WorkloadOptionError, match=r"workload 'gsm8k': option 'n': Input should be greater than 0"):
        get_workload("gsm8k", n=0, data_dir=data_dir)


def test_an_unknown_option_is_rejected_with_the_valid_options_listed(data_dir):
    with pytest.raises(WorkloadOptionError, match=r"option 'shots'.*\(options: seed, data_dir, n, num_fewshot"):
        get_workload("gsm8k", shots=3, data_dir=data_dir)


def test_registering_a_second_workload_under_a_taken_name_fails():
    with pytest.raises(ValueError, match="already registered"):
        register_workload("gsm8k")(type("Other", (Workload,), {}))


def test_a_throughput_workload_refuses_to_score(data_dir):
    workload = get_workload("sharegpt", data_dir=data_dir)
    assert workload.kind == "throughput"
    with pytest.raises(TypeError, match="throughput workload"):
        workload.score(None, "text")
