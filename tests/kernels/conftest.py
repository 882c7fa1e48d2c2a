"""Kernel tests run on the CPU through Triton's interpreter unless a GPU is present."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported

import triton.runtime.interpreter as _interpreter  # noqa: E402

_patch_lang_tensor = _interpreter._patch_lang_tensor


def _patch_with_numpy2_index(tensor, scope):
    """The interpreter holds scalars as 1-element arrays and converts loop bounds with int(array), which
    NumPy >= 2.3 refuses for arrays of 1 dimension; convert with .item() instead."""
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))


_interpreter._patch_lang_tensor = _patch_with_numpy2_index
