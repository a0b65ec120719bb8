"""Build the Cython extensions; all metadata lives in pyproject.toml."""
from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    # Raw syscalls: no libaio, no libaio-dev.
    Extension("aioswap._aio", ["aioswap/_aio.pyx"], extra_compile_args=["-O2"]),
    # cuFile is dlopen'ed at run time: no CUDA headers or libraries at build time.
    Extension("aioswap._cufile", ["aioswap/_cufile.pyx"], libraries=["dl"],
              extra_compile_args=["-O2"]),
]

setup(ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"}))
