"""Compiles the native kernels' variants into the package at build time (`pip install .`,
`pip install -e .`, `pip wheel .`); pyproject.toml holds everything else.

torch's own extension builder (BuildExtension over setuptools) compiles them: the same builder,
flags and torch ABI settings as the first-use build in treadle/model/kernels.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
from pathlib import Path

from setuptools import setup
from setuptools.errors import CompileError
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).parent
_spec = importlib.util.spec_from_file_location(
    "kernel_variants", ROOT / "treadle" / "model" / "kernel_variants.py"
)
variants = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(variants)


def extension_name(variant: str) -> str:
    return f"treadle.model.prebuilt.{variants.library_name(variant)}"


def extensions() -> list[CppExtension]:
    machine = platform.machine()
    if machine not in variants.X86_64:
        return []  # no prebuilt variant: kernels.py builds the generic one at first use
    sources = [str(p.relative_to(ROOT)) for p in variants.source_files() if p.suffix == ".cpp"]
    headers = [str(p.relative_to(ROOT)) for p in variants.source_files() if p.suffix != ".cpp"]
    extensions = []
    for variant in variants.PREBUILT:
        cflags, ldflags = variants.build_flags(machine, variant)
        extensions.append(
            CppExtension(
                extension_name(variant),
                sources,
                depends=headers,
                extra_compile_args=cflags,
                extra_link_args=ldflags,
                optional=True,
            )
        )
    return extensions


class BuildVariants(BuildExtension):
    """One object folder per variant (they compile the same sources, whose objects would
    overwrite each other's), a failed variant a warning (without a compiler the package still
    installs and serves on the torch path), and the manifest kernels.py checks before loading."""

    def build_extension(self, ext) -> None:
        build_temp = self.build_temp
        self.build_temp = os.path.join(build_temp, ext.name)
        try:
            super().build_extension(ext)  # skipped where the library is newer than its sources
        except Exception as e:  # torch's ninja build fails with RuntimeError
            # An older build's library must not pass for this one in the manifest.
            Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
            raise CompileError(str(e)) from e
        finally:
            self.build_temp = build_temp

    def run(self) -> None:
        super().run()
        import torch

        libraries = {
            variant: Path(self.get_ext_fullpath(extension_name(variant)))
            for variant in variants.PREBUILT
        }
        folder = next(iter(libraries.values())).parent
        manifest = {
            "sources": variants.source_hash(),
            "torch": torch.__version__,
            "libraries": {
                variant: library.name for variant, library in libraries.items() if library.exists()
            },
        }
        (folder / variants.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildVariants})
