"""Build of ddiloco's one optional compiled module (the metadata is pyproject.toml's).

``ddiloco_cli.numerics._native``: the int4/int8 quantiser, dequantiser and per-block sums of
squares in one pass each, the GIL released. ``optional=True``: where it cannot be compiled (no C compiler, another compiler's
flags) the install goes on without it and ddiloco runs the same arithmetic in numpy, with the
same bytes (ddiloco_cli/numerics/native.py)."""

import sys

from setuptools import Extension, setup

# IEEE fp32 exactly as written: no fused multiply-add, no fast-math (gcc and clang)
FLAGS = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off", "-fno-fast-math", "-std=c99"]

setup(ext_modules=[Extension("ddiloco_cli.numerics._native", ["ddiloco_cli/numerics/_native.c"],
                             extra_compile_args=FLAGS, optional=True)])
