"""LongBench metrics against examples computed by hand, following the official metrics.py rules."""

import pytest

from pipeline.workloads.longbench_metrics import (
    classification_score,
    code_sim_score,
    count_score,
    longbench_average,
    normalize_answer,
    qa_f1_score,
    retrieval_score,
    rouge_score,
    score_prediction,
)


def test_normalization_lowercases_and_drops_punctuation_articles_and_extra_spaces():
    assert normalize_answer("  The Cat, sat!  on a   MAT. ") == "cat sat on mat"
    # Punctuation goes first, so "an-the" becomes the word "anthe", which is no article.
    assert normalize_answer("an-the apple") == "anthe apple"


def test_qa_f1_counts_shared_tokens_after_normalization():
    # prediction tokens: cat sat on mat (4); reference: cat sat (2); shared 2 -> P 1/2, R 1, F1 2/3
    assert qa_f1_score("the cat sat on the mat", "A cat sat.") == pytest.approx(2 / 3)
    # repeated tokens count as often as both sides hold them: shared {paris: 1} -> P 1/2, R 1/1
    assert qa_f1_score("Paris Paris", "paris") == pytest.approx(2 / 3)
    assert qa_f1_score("London", "Paris") == 0.0
    assert qa_f1_score("", "Paris") == 0.0


def test_rouge_l_is_the_f_measure_of_the_longest_common_subsequence():
    # LCS "the cat on the mat" = 5 of 6 tokens on both sides -> P = R = F = 5/6
    assert rouge_score("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(5 / 6)
    # LCS "the gunman" = 2; P = 2/6, R = 2/4 -> F = 2PR/(P+R) = 0.4
    assert rouge_score("the gunman was shot by police", "police shot the gunman") == pytest.approx(0.4)
    assert rouge_score("", "police shot the gunman") == 0.0


def test_classification_credits_the_reference_class_split_among_all_classes_named():
    classes = ["Food", "Date", "Individual", "entity", "Other entity"]
    assert classification_score("Individual", "Individual", all_classes=classes) == 1.0
    assert classification_score("Food or Date", "Date", all_classes=classes) == 0.5
    assert classification_score("Food", "Date", all_classes=classes) == 0.0
    # "entity" is only part of the reference "Other entity", so it does not count as a second class.
    assert classification_score("Other entity", "Other entity", all_classes=classes) == 1.0


def test_classification_keeps_the_official_loop_that_skips_after_a_removal():
    # Both "a" and "b" are parts of the reference "a b"; the official loop removes "a", then skips "b".
    assert classification_score("a b", "a b", all_classes=["a", "b", "a b"]) == 0.5


def test_retrieval_is_the_share_of_numbers_in_the_answer_naming_the_right_paragraph():
    assert retrieval_score("Paragraph 19", "Paragraph 19") == 1.0
    assert retrieval_score("Paragraph 3 or Paragraph 19", "Paragraph 19") == 0.5
    assert retrieval_score("I do not know", "Paragraph 19") == 0.0


def test_count_is_the_share_of_numbers_in_the_answer_equal_to_the_count():
    assert count_score("46", "46") == 1.0
    assert count_score("There are 46 unique paragraphs out of 50", "46") == 0.5
    assert count_score("forty-six", "46") == 0.0


def test_code_similarity_compares_the_first_line_that_is_not_a_comment_or_fence():
    reference = "            if e.text == language:"  # 12 spaces + 22 characters = 34
    prediction = "\n```python\n# check the language\n    if e.text == language:\n        break"
    # The kept line (26 characters) lies inside the reference: difflib ratio 2*26/60 = 0.8667 -> 87 %.
    assert code_sim_score(prediction, reference) == 0.87
    assert code_sim_score(reference + "\n", reference) == 1.0
    assert code_sim_score("# only a comment", reference) == 0.0


def test_few_shot_tasks_score_only_the_first_line_of_the_prediction():
    assert score_prediction("triviaqa", "\nParis\nLondon", ["London"], None) == 0.0
    assert score_prediction("qasper", "\nParis\nLondon", ["London"], None) == pytest.approx(2 / 3)


def test_a_prediction_scores_its_best_match_among_the_reference_answers():
    assert score_prediction("triviaqa", "fifty-five", ["55", "fifty-five"], None) == 1.0


def test_the_average_is_the_unweighted_mean_over_tasks():
    assert longbench_average({"qasper": 0.2, "trec": 0.6, "lcc": 1.0}) == pytest.approx(0.6)
    with pytest.raises(ValueError):
        longbench_average({})
