"""Makes ``lm-eval --model kivi`` work: registers ``kivi.lm_eval_model:KiviLM`` as lm-eval's model "kivi".

lm-eval 0.4.13 discovers no model plugins, so ``kivi_lm_eval_hook.pth`` (put into site-packages by
setup.py) imports this module at every interpreter start. That has to stay cheap: nothing here imports
lm_eval or torch. A meta-path finder waits for ``lm_eval.models`` (which lm-eval's ``get_model`` imports
before its first lookup) and, once that module has run, registers "kivi" as a lazy "module:Class"
target: kivi and its torch imports load only when the model is asked for.
"""

import sys

WATCHED = "lm_eval.models"
NAME, TARGET = "kivi", "kivi.lm_eval_model:KiviLM"


class _RegisterAfterExec:
    """The loader of lm_eval.models, registering "kivi" right after the module has run."""

    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):  # everything else (resource readers, get_code, …) is the real loader's
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        from lm_eval.api.registry import model_registry

        if NAME not in model_registry:  # a future lm-eval with its own "kivi" wins instead of failing
            model_registry.register(NAME, target=TARGET)


class _Finder:
    """Finds lm_eval.models through the finders after it, and wraps its loader; finds nothing else."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != WATCHED:
            return None
        for finder in sys.meta_path[sys.meta_path.index(cls) + 1 :]:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _RegisterAfterExec(spec.loader)
                return spec
        return None


if _Finder not in sys.meta_path:
    sys.meta_path.insert(0, _Finder)
