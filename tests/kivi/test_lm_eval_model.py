"""lm-eval's model "kivi": registered at start-up by the installed .pth hook, its KIVI args checked before any load."""

import subprocess
import sys
from pathlib import Path

import pytest

from kivi import KiviConfigError

pytest.importorskip("lm_eval")
LM_EVAL = str(Path(sys.executable).with_name("lm-eval"))
TASKS = Path(__file__).resolve().parents[2] / "configs" / "lm_eval"
MISSING_MODEL = "/nonexistent/model"  # loading it would fail: an error about KIVI proves nothing was loaded


def python(code: str) -> list[str]:
    """The words a fresh interpreter of this environment prints."""
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_startup_hook_imports_neither_lm_eval_nor_torch():
    loaded = python("import sys; print(*(m in sys.modules for m in ('kivi_lm_eval_hook', 'lm_eval', 'torch', 'kivi')))")
    assert loaded == ["True", "False", "False", "False"]


def test_lm_eval_finds_kivi_beside_its_own_models_in_a_fresh_interpreter():
    found = python("from lm_eval.api.registry import get_model as g; print(g('kivi').__module__, g('kivi').__name__, g('hf').__name__)")
    assert found == ["kivi.lm_eval_model", "KiviLM", "HFLM"]


@pytest.mark.parametrize("args, message", [
    ({"k_bits": 3}, "KiviConfig.k_bits=3 is not supported"),
    ({"group_size": "big"}, "KiviConfig.group_size='big'"),
    ({"kivi": "kivi-2", "residual_length": 40}, "residual_length=40 must be >= 0 and a multiple of group_size=32"),
    ({"kivi": "kivi-3"}, "unknown KIVI preset 'kivi-3'"),
    ({"key_axis": "channels"}, "did you mean 'channel'"),
    ({"kbits": 2}, r"model_args kbits=2: no KIVI field and no HF argument \(did you mean 'k_bits'\?\)"),
])
def test_bad_kivi_args_raise_before_the_model_loads(args, message):
    from kivi.lm_eval_model import KiviLM

    with pytest.raises(KiviConfigError, match=message):
        KiviLM(pretrained=MISSING_MODEL, device="cpu", **args)


def test_the_lm_eval_command_line_reports_a_bad_kivi_arg_before_loading_anything(tmp_path):
    done = subprocess.run(
        [LM_EVAL, "run", "--model", "kivi", "--model_args", f"pretrained={MISSING_MODEL},k_bits=2,v_bits=5",
         "--device", "cpu", "--tasks", "gsm8k_local", "--include_path", str(TASKS), "--output_path", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode != 0
    assert "KiviConfigError: KiviConfig.v_bits=5 is not supported" in done.stderr
    assert "Using device" not in done.stderr  # HFLM.__init__, which logs it first, never ran
