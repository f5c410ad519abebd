"""The one compiled part: kvxfer's streaming copy (everything else is in pyproject.toml).

Optional: where no C compiler is found the build goes on without it, and
``kvxfer.transfer.converted.stream_copy`` copies with numpy instead (slower, the same bytes).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvxfer.transfer.converted._stream_copy",
                             ["kvxfer/transfer/converted/_stream_copy.c"],
                             extra_compile_args=["-O2"], optional=True)])
