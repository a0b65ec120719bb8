# cython: language_level=3, embedsignature=True
"""cuFile (GPUDirect Storage) binding, loaded with dlopen at run time (being written)."""
