"""Puts kivi_lm_eval_hook.pth into site-packages, so that `lm-eval --model kivi` works (see kivi_lm_eval_hook.py).

The metadata is in pyproject.toml; setuptools has no option for a file at the root of site-packages.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "kivi_lm_eval_hook.pth"  # site runs .pth files in name order: after __editable__.*.pth, which finds the hook


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        # A wheel gets build_lib's root. An editable wheel (PEP 660) holds only a finder for the sources,
        # plus what `install` writes to its install_lib, which is that wheel's root.
        root = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        Path(root, PTH).write_text("import kivi_lm_eval_hook\n")


setup(cmdclass={"build_py": build_py_with_pth})
