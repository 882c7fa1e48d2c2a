"""LongBench v1's official metrics (THUDM/LongBench metrics.py and eval.py), per task.

One deliberate difference: ROUGE-L comes from Google's rouge-score package (RougeScorer rougeL F,
no stemming) instead of the unmaintained `rouge` package the official code imports; both take the
LCS F-measure, but their tokenizers differ slightly, so summary scores can differ from published ones
in the decimals. code_sim_score uses difflib, as fuzzywuzzy does without python-Levenshtein (the
official requirements do not install it).
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rouge_score.rouge_scorer import RougeScorer

Metric = Callable[..., float]
PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, then drop punctuation, then the articles a/an/the, then collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def qa_f1_score(prediction: str, ground_truth: str, **_: object) -> float:
    pred_tokens = normalize_answer(prediction).split()
    truth_tokens = normalize_answer(ground_truth).split()
    same = sum((Counter(pred_tokens) & Counter(truth_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(truth_tokens)
    return 2 * precision * recall / (precision + recall)


@cache
def _rouge() -> RougeScorer:
    # Imported at the first summary scored, not with the workloads: rouge-score imports nltk, which imports scipy
    # and scikit-learn (2 s), and validating a config or listing the workloads scores nothing.
    from rouge_score.rouge_scorer import RougeScorer

    return RougeScorer(["rougeL"], use_stemmer=False)


def rouge_score(prediction: str, ground_truth: str, **_: object) -> float:
    return _rouge().score(ground_truth, prediction)["rougeL"].fmeasure


def classification_score(prediction: str, ground_truth: str, *, all_classes: Sequence[str], **_: object) -> float:
    matches = [name for name in all_classes if name in prediction]
    # The official loop removes from the list it iterates over, so it skips the element after each
    # removal; kept as is so that trec scores equal the official ones.
    for term in matches:
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _number_share(prediction: str, target: str) -> float:
    # Official rule for the synthetic tasks: the share of all numbers in the prediction equal to target.
    numbers = re.findall(r"\d+", prediction)
    return sum(number == target for number in numbers) / len(numbers) if numbers else 0.0


def retrieval_score(prediction: str, ground_truth: str, **_: object) -> float:
    return _number_share(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


def count_score(prediction: str, ground_truth: str, **_: object) -> float:
    return _number_share(prediction, str(ground_truth))


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy's fuzz.ratio without python-Levenshtein: difflib ratio in rounded percent."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return round(100 * difflib.SequenceMatcher(None, a, b).ratio())


def code_sim_score(prediction: str, ground_truth: str, **_: object) -> float:
    lines = prediction.lstrip("\n").split("\n")
    code = next((line for line in lines if "`" not in line and "#" not in line and "//" not in line), "")
    return fuzz_ratio(code, ground_truth) / 100


TASK_METRICS: dict[str, Metric] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "passage_count": count_score,
    "passage_retrieval_en": retrieval_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}
FIRST_LINE_TASKS = frozenset({"trec", "triviaqa", "samsum"})  # few-shot tasks: models ramble on


def score_prediction(task: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None) -> float:
    """The official per-sample score: the task's metric, best over the reference answers."""
    if task in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = TASK_METRICS[task]
    return max((metric(prediction, answer, all_classes=all_classes) for answer in answers), default=0.0)


def longbench_average(task_scores: Mapping[str, float]) -> float:
    """LongBench's headline number: the unweighted mean of per-task mean scores."""
    if not task_scores:
        raise ValueError("no LongBench task scores to average")
    return sum(task_scores.values()) / len(task_scores)
