"""Evaluation workloads: requests from a data set, and a score for each prediction.

    workload = get_workload("gsm8k", n=100, data_dir="../shared/data")
    workload.check_data()                      # cheap; raises DataSourceError before models load
    requests = workload.requests(tokenizer, max_context=4096)
    workload.skipped                           # Counter of records dropped, per reason
    workload.score(requests[0], prediction)    # Score(value in [0, 1], metric)
"""

from pipeline.workloads import fidelity, gsm8k, longbench, niah, sharegpt  # noqa: F401  (they register themselves)
from pipeline.workloads.base import (
    BudgetError,
    Request,
    Score,
    TeacherForcing,
    Workload,
    WorkloadOptionError,
    WorkloadOptions,
    chat_template_tokens,
    check_budget,
    prompt_tokens,
    render_prompt,
)
from pipeline.workloads.data import DataSourceError, resolve_data_dir
from pipeline.workloads.longbench_metrics import longbench_average
from pipeline.workloads.registry import (
    UnknownWorkloadError,
    get_workload,
    register_workload,
    workload_class,
    workload_names,
)

__all__ = [
    "BudgetError",
    "DataSourceError",
    "Request",
    "Score",
    "TeacherForcing",
    "UnknownWorkloadError",
    "Workload",
    "WorkloadOptionError",
    "WorkloadOptions",
    "chat_template_tokens",
    "check_budget",
    "get_workload",
    "longbench_average",
    "prompt_tokens",
    "register_workload",
    "render_prompt",
    "resolve_data_dir",
    "workload_class",
    "workload_names",
]
