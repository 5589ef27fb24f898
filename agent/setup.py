"""The one compiled part of the agent: the Flight Recorder pickle decoder (optional).

Everything else is in pyproject.toml. The extension is optional: where it cannot be built (no C
compiler), the importer reads dumps with its Python reader, which gives the same tables.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "comminsight.importers._frdecode",
            ["comminsight/importers/_frdecode.c"],
            extra_compile_args=["-O3", "-std=c99", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
