"""Data of the offline lm-eval tasks in this folder: local copies laid out as ../shared/data (see its README)."""

import os
from pathlib import Path

import datasets


def gsm8k(data_dir: str | None = None, **_task_metadata):
    """GSM8K's train and test splits from DATA/gsm8k/*.jsonl, DATA = --metadata data_dir=… or $KIVI_DATA_DIR."""
    data_dir = data_dir or os.environ.get("KIVI_DATA_DIR")
    if not data_dir:
        raise ValueError("gsm8k_local: pass --metadata data_dir=PATH or set KIVI_DATA_DIR (PATH/gsm8k/test.jsonl …)")
    files = {split: str(Path(data_dir, "gsm8k", f"{split}.jsonl")) for split in ("train", "test")}
    missing = [path for path in files.values() if not Path(path).is_file()]
    if missing:
        raise FileNotFoundError(f"gsm8k_local: no {', '.join(missing)}")
    return datasets.load_dataset("json", data_files=files)
