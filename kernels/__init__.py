"""Triton kernels, installed as ``megafixed.kernels``.

``token_codes`` is the one entry point the model calls: the Triton kernel for CUDA tensors (or
when forced under ``TRITON_INTERPRET=1``), the plain-torch reference everywhere else. Triton is
optional: without it every call takes the torch path.
"""
import sys

if __name__ == "kernels":
    # Imported as a top-level `kernels`: a checkout's root is on sys.path (`python -m pytest` or `python -m
    # megafixed.cli` run from it puts the working directory first), and this folder shadows the registry's
    # `kernels` package (HF's hub kernels), which transformers >= 5.25 imports whenever it is installed
    # (else "cannot import name 'CUDAProperties' from 'kernels'"). Hand the name to the installed package,
    # found on the rest of sys.path, or to none.
    import importlib.machinery
    import importlib.util
    import os

    _root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    _rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _rest)
    if _spec is None:
        raise ModuleNotFoundError("No module named 'kernels' (megafixed's Triton kernels import as "
                                  "megafixed.kernels)", name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds once this ends
    try:
        _spec.loader.exec_module(_module)
    except BaseException:
        sys.modules.pop("kernels", None)
        raise
else:
    from .token_codes import (  # noqa: F401
                              HAVE_TRITON,
                              KERNEL_DTYPES,
                              kernel_is_interpreted,
                              token_codes,
                              token_codes_kernel,
                              token_codes_reference,
    )
