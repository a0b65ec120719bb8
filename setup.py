"""Build the Cython extensions and ship the DeepSpeed hook; all metadata is in pyproject.toml."""
import glob
import os

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_py import build_py

# Runs aioswap.compat.deepspeed.install() at interpreter start when AIOSWAP_DEEPSPEED=1
# (and does nothing else). A .pth file works only at the top of site-packages.
PTH = "aioswap-deepspeed.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithPth(build_py):
    """build_py that also puts aioswap-deepspeed.pth at the root of the wheel."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            # Editable wheels (PEP 660): setuptools points install_lib at the unpacked wheel
            # directory, whose files all go into the wheel; build_lib is thrown away.
            target = self.get_finalized_command("install").install_lib
        else:
            target = self.build_lib
        self.copy_file(os.path.join(HERE, PTH), os.path.join(target, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, PTH))
        return outputs


# Released builds carry no debug info (it was most of the .so: 3 MB): -g0 overrides Python's
# own -g, and the linker strips symbols. AIOSWAP_DEBUG_BUILD=1 keeps both for gdb.
_DEBUG = os.environ.get("AIOSWAP_DEBUG_BUILD") == "1"
_CFLAGS = ["-O2"] + ([] if _DEBUG else ["-g0"])
_LDFLAGS = [] if _DEBUG else ["-s"]

extensions = [
    # Raw syscalls: no liburing, no libaio, no libaio-dev (the headers are the kernel's).
    Extension("aioswap._aio", ["aioswap/_aio.pyx"], extra_compile_args=_CFLAGS,
              extra_link_args=_LDFLAGS,
              depends=["aioswap/_uring.h", "aioswap/_kthreads.h", "aioswap/_statlite.h"]
              + sorted(glob.glob(os.path.join(HERE, "aioswap", "_engine", "*.pxi")))),
    # IOFuture, compiled from its .py source: finishing a future runs no Python bytecode, so
    # a signal handler (KeyboardInterrupt) cannot land in the middle of a delivery that the
    # thread waiting in wait() or result() runs for the lanes (see aioswap/_future.py).
    Extension("aioswap._future", ["aioswap/_future.py"], extra_compile_args=_CFLAGS,
              extra_link_args=_LDFLAGS),
    # cuFile is dlopen'ed at run time: no CUDA headers or libraries at build time.
    Extension("aioswap._cufile", ["aioswap/_cufile.pyx"], libraries=["dl"],
              extra_compile_args=_CFLAGS, extra_link_args=_LDFLAGS),
]

setup(ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"}),
      cmdclass={"build_py": BuildPyWithPth})
