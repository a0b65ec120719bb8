# cython: language_level=3, embedsignature=True
"""cuFile (GPUDirect Storage), loaded with ``dlopen`` at run time.

Nothing here needs CUDA to build or to import: the subset of ``cufile.h`` in use is declared
in ``_cufile_api.pxd`` and every entry point is resolved with ``dlsym`` the first time cuFile
is used (:func:`load`). Where the library is missing, every call that needs it raises
:class:`~aioswap.errors.CuFileUnavailable` naming each place that was tried.

- :func:`driver_open` / :func:`driver_close` (or :class:`Driver`) are reference counted: the
  first user opens the cuFile driver, the last one closes it. File and buffer registrations
  hold a reference of their own.
- :class:`CuFileHandle` registers a file with ``cuFileHandleRegister``; handles on the same
  open file share one registration. ``read``/``write`` continue short counts to completion.
- :func:`buf_register` / :func:`buf_deregister` register device memory and record the range,
  so I/O on any address inside it is issued against the registered base with an offset, as
  cuFile requires.

Nothing here knows about torch: device memory is a raw address whose owner the caller keeps
alive. cuFile writes ``cufile.log`` into the current directory by default; unless
``CUFILE_LOGFILE_PATH`` is set, aioswap points it at a private temporary directory instead.
"""
cimport aioswap._cufile_api as cf
from cpython.exc cimport PyErr_CheckSignals
cimport libc.errno as cerrno
from libc.errno cimport EINTR, EINVAL, EIO
from libc.stdint cimport uintptr_t
from libc.string cimport memset
from posix.dlfcn cimport RTLD_LOCAL, RTLD_NOW, dlclose, dlerror, dlopen, dlsym
from posix.types cimport off_t

import atexit
import bisect
import fcntl
import glob
import io
import json
import logging
import operator
import os
import sys
import tempfile
import threading
import warnings
from collections.abc import Mapping

from aioswap.errors import (CuFileError, CuFileUnavailable, DirectIOUnsupportedError,
                            HandleClosedError, ShortReadError)

cdef extern from "<dlfcn.h>" nogil:
    # GNU extensions; Python.h defines _GNU_SOURCE before this header is included.
    ctypedef struct Dl_info:
        const char* dli_fname
        void* dli_fbase
        const char* dli_sname
        void* dli_saddr
    int dladdr(const void* addr, Dl_info* info)
    int RTLD_NOLOAD

# cuGetErrorName of cuda.h, looked up in an already loaded libcuda for error messages only.
ctypedef int (*_cuGetErrorName_t)(int error, const char** name) noexcept nogil

__all__ = [
    "CuFileHandle",
    "DeviceRangeRegistry",
    "Driver",
    "available",
    "buf_deregister",
    "buf_register",
    "driver_close",
    "driver_open",
    "driver_users",
    "error_message",
    "error_name",
    "library_path",
    "load",
    "registered_range",
    "version",
]

_log = logging.getLogger("aioswap")

LIB_ENV = "AIOSWAP_CUFILE_LIB"
SONAMES = ("libcufile.so.0", "libcufile.so")

# (name, message) of each CUfileOpError, as cufile.h's cufileop_status_error() words them.
_ERRORS = {
    cf.CU_FILE_SUCCESS: ("CU_FILE_SUCCESS", "cufile success"),
    cf.CU_FILE_DRIVER_NOT_INITIALIZED: ("CU_FILE_DRIVER_NOT_INITIALIZED",
                                        "nvidia-fs driver is not loaded"),
    cf.CU_FILE_DRIVER_INVALID_PROPS: ("CU_FILE_DRIVER_INVALID_PROPS", "invalid property"),
    cf.CU_FILE_DRIVER_UNSUPPORTED_LIMIT: ("CU_FILE_DRIVER_UNSUPPORTED_LIMIT",
                                          "property range error"),
    cf.CU_FILE_DRIVER_VERSION_MISMATCH: ("CU_FILE_DRIVER_VERSION_MISMATCH",
                                         "nvidia-fs driver version mismatch"),
    cf.CU_FILE_DRIVER_VERSION_READ_ERROR: ("CU_FILE_DRIVER_VERSION_READ_ERROR",
                                           "nvidia-fs driver version read error"),
    cf.CU_FILE_DRIVER_CLOSING: ("CU_FILE_DRIVER_CLOSING", "driver shutdown in progress"),
    cf.CU_FILE_PLATFORM_NOT_SUPPORTED: ("CU_FILE_PLATFORM_NOT_SUPPORTED",
                                        "GPUDirect Storage not supported on current platform"),
    cf.CU_FILE_IO_NOT_SUPPORTED: ("CU_FILE_IO_NOT_SUPPORTED",
                                  "GPUDirect Storage not supported on current file"),
    cf.CU_FILE_DEVICE_NOT_SUPPORTED: ("CU_FILE_DEVICE_NOT_SUPPORTED",
                                      "GPUDirect Storage not supported on current GPU"),
    cf.CU_FILE_NVFS_DRIVER_ERROR: ("CU_FILE_NVFS_DRIVER_ERROR", "nvidia-fs driver ioctl error"),
    cf.CU_FILE_CUDA_DRIVER_ERROR: ("CU_FILE_CUDA_DRIVER_ERROR", "CUDA Driver API error"),
    cf.CU_FILE_CUDA_POINTER_INVALID: ("CU_FILE_CUDA_POINTER_INVALID", "invalid device pointer"),
    cf.CU_FILE_CUDA_MEMORY_TYPE_INVALID: ("CU_FILE_CUDA_MEMORY_TYPE_INVALID",
                                          "invalid pointer memory type"),
    cf.CU_FILE_CUDA_POINTER_RANGE_ERROR: ("CU_FILE_CUDA_POINTER_RANGE_ERROR",
                                          "pointer range exceeds allocated address range"),
    cf.CU_FILE_CUDA_CONTEXT_MISMATCH: ("CU_FILE_CUDA_CONTEXT_MISMATCH", "cuda context mismatch"),
    cf.CU_FILE_INVALID_MAPPING_SIZE: ("CU_FILE_INVALID_MAPPING_SIZE",
                                      "access beyond maximum pinned size"),
    cf.CU_FILE_INVALID_MAPPING_RANGE: ("CU_FILE_INVALID_MAPPING_RANGE",
                                       "access beyond mapped size"),
    cf.CU_FILE_INVALID_FILE_TYPE: ("CU_FILE_INVALID_FILE_TYPE", "unsupported file type"),
    cf.CU_FILE_INVALID_FILE_OPEN_FLAG: ("CU_FILE_INVALID_FILE_OPEN_FLAG",
                                        "unsupported file open flags"),
    cf.CU_FILE_DIO_NOT_SET: ("CU_FILE_DIO_NOT_SET", "fd direct IO not set"),
    cf.CU_FILE_INVALID_VALUE: ("CU_FILE_INVALID_VALUE", "invalid arguments"),
    cf.CU_FILE_MEMORY_ALREADY_REGISTERED: ("CU_FILE_MEMORY_ALREADY_REGISTERED",
                                           "device pointer already registered"),
    cf.CU_FILE_MEMORY_NOT_REGISTERED: ("CU_FILE_MEMORY_NOT_REGISTERED",
                                       "device pointer lookup failure"),
    cf.CU_FILE_PERMISSION_DENIED: ("CU_FILE_PERMISSION_DENIED", "driver or file access error"),
    cf.CU_FILE_DRIVER_ALREADY_OPEN: ("CU_FILE_DRIVER_ALREADY_OPEN", "driver is already open"),
    cf.CU_FILE_HANDLE_NOT_REGISTERED: ("CU_FILE_HANDLE_NOT_REGISTERED",
                                       "file descriptor is not registered"),
    cf.CU_FILE_HANDLE_ALREADY_REGISTERED: ("CU_FILE_HANDLE_ALREADY_REGISTERED",
                                           "file descriptor is already registered"),
    cf.CU_FILE_DEVICE_NOT_FOUND: ("CU_FILE_DEVICE_NOT_FOUND", "GPU device not found"),
    cf.CU_FILE_INTERNAL_ERROR: ("CU_FILE_INTERNAL_ERROR", "internal error"),
    cf.CU_FILE_GETNEWFD_FAILED: ("CU_FILE_GETNEWFD_FAILED",
                                 "failed to obtain new file descriptor"),
    cf.CU_FILE_NVFS_SETUP_ERROR: ("CU_FILE_NVFS_SETUP_ERROR", "NVFS driver initialization error"),
    cf.CU_FILE_IO_DISABLED: ("CU_FILE_IO_DISABLED",
                             "GPUDirect Storage disabled by config on current file"),
    cf.CU_FILE_BATCH_SUBMIT_FAILED: ("CU_FILE_BATCH_SUBMIT_FAILED",
                                     "failed to submit batch operation"),
    cf.CU_FILE_GPU_MEMORY_PINNING_FAILED: ("CU_FILE_GPU_MEMORY_PINNING_FAILED",
                                           "failed to allocate pinned GPU memory"),
    cf.CU_FILE_BATCH_FULL: ("CU_FILE_BATCH_FULL", "queue full for batch operation"),
    cf.CU_FILE_ASYNC_NOT_SUPPORTED: ("CU_FILE_ASYNC_NOT_SUPPORTED",
                                     "cuFile stream operation not supported"),
    cf.CU_FILE_INTERNAL_BATCH_SETUP_ERROR: ("CU_FILE_INTERNAL_BATCH_SETUP_ERROR",
                                            "batch setup internal error"),
    cf.CU_FILE_INTERNAL_BATCH_SUBMIT_ERROR: ("CU_FILE_INTERNAL_BATCH_SUBMIT_ERROR",
                                             "batch submit internal error"),
    cf.CU_FILE_INTERNAL_BATCH_GETSTATUS_ERROR: ("CU_FILE_INTERNAL_BATCH_GETSTATUS_ERROR",
                                                "batch get status internal error"),
    cf.CU_FILE_INTERNAL_BATCH_CANCEL_ERROR: ("CU_FILE_INTERNAL_BATCH_CANCEL_ERROR",
                                             "batch cancel internal error"),
    cf.CU_FILE_NOMEM_ERROR: ("CU_FILE_NOMEM_ERROR", "cuFile out of memory"),
    cf.CU_FILE_IO_ERROR: ("CU_FILE_IO_ERROR", "cuFile I/O error"),
    cf.CU_FILE_INTERNAL_BUF_REGISTER_ERROR: ("CU_FILE_INTERNAL_BUF_REGISTER_ERROR",
                                             "cuFile buffer registration error"),
    cf.CU_FILE_HASH_OPR_ERROR: ("CU_FILE_HASH_OPR_ERROR", "cuFile hash operation error"),
    cf.CU_FILE_INVALID_CONTEXT_ERROR: ("CU_FILE_INVALID_CONTEXT_ERROR",
                                       "cuFile invalid context"),
    cf.CU_FILE_NVFS_INTERNAL_DRIVER_ERROR: ("CU_FILE_NVFS_INTERNAL_DRIVER_ERROR",
                                            "nvidia-fs internal driver error"),
    cf.CU_FILE_BATCH_NOCOMPAT_ERROR: ("CU_FILE_BATCH_NOCOMPAT_ERROR",
                                      "batch I/O needs compatibility mode, which is off"),
    cf.CU_FILE_IO_MAX_ERROR: ("CU_FILE_IO_MAX_ERROR", "GPUDirect Storage max error"),
}

# A few CUresult names for messages when libcuda cannot name them itself (cuda.h values).
_CUDA_ERRORS = {
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED",
    34: "CUDA_ERROR_STUB_LIBRARY",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    201: "CUDA_ERROR_INVALID_CONTEXT",
    999: "CUDA_ERROR_UNKNOWN",
}


def error_name(int code):
    """Return the ``CU_FILE_*`` name of a cuFile status code (sign ignored).

    Unknown codes get ``"CU_FILE_UNKNOWN_ERROR"``.
    """
    entry = _ERRORS.get(abs(code))
    return "CU_FILE_UNKNOWN_ERROR" if entry is None else entry[0]


def error_message(int code):
    """Return cufile.h's description of a cuFile status code (sign ignored).

    Unknown codes get ``"unknown cuFile error <code>"``.
    """
    entry = _ERRORS.get(abs(code))
    return f"unknown cuFile error {abs(code)}" if entry is None else entry[1]


cdef str _cuda_error_name(int code):
    """Name a CUresult, asking a libcuda that is already loaded (never loading one)."""
    cdef void* lib
    cdef _cuGetErrorName_t fn
    cdef const char* name = NULL
    cdef int rc = -1
    lib = dlopen(b"libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)
    if lib != NULL:
        fn = <_cuGetErrorName_t>dlsym(lib, b"cuGetErrorName")
        if fn != NULL:
            rc = fn(code, &name)
        dlclose(lib)
    if rc == 0 and name != NULL:
        return name.decode("ascii", "replace")
    return _CUDA_ERRORS.get(code, "")


def _status_error(int err, int cu_err, str what):
    """The :class:`CuFileError` for a failed status call (``CUfileError_t`` = err, cu_err)."""
    msg = f"{what} failed: {error_name(err)}: {error_message(err)}"
    if err == cf.CU_FILE_CUDA_DRIVER_ERROR:
        name = _cuda_error_name(cu_err)
        msg += f" (CUresult {cu_err}{' ' + name if name else ''})"
    exc = CuFileError(err, msg)
    exc.cu_err = cu_err
    return exc


cdef int _check_status(cf.CUfileError_t st, str what) except -1:
    """Checker of every call that returns ``CUfileError_t``."""
    if st.err != cf.CU_FILE_SUCCESS:
        raise _status_error(st.err, st.cu_err, what)
    return 0


def _map_io_result(ssize_t ret, int err, str op="cuFileRead", nbytes=0, file_offset=0,
                   done=0, path=None):
    """Map a ``cuFileRead``/``cuFileWrite`` result to a :class:`CuFileError`, or None if >= 0.

    ``-1`` means ``err`` holds the errno; any other negative value is a negated
    ``CUfileOpError`` (a small negative that is not one is taken as a negated errno).
    """
    if ret >= 0:
        return None
    if ret == -1:
        code = err if err else EIO
        detail = os.strerror(err) if err else "failed without setting errno"
    else:
        code = <long long>-ret
        if code > cf.CUFILEOP_BASE_ERR:
            detail = f"{error_name(code)}: {error_message(code)}"
        else:
            detail = os.strerror(code)
    msg = (f"{op} of {nbytes} bytes at file offset {file_offset}: {detail} "
           f"({done} bytes done)")
    exc = CuFileError(code, msg) if path is None else CuFileError(code, msg, path)
    exc.offset = file_offset + done
    return exc


cdef ssize_t _check_io(ssize_t ret, int err, str op, size_t nbytes, off_t file_offset,
                       size_t done, object path) except -1:
    """Checker of every ``cuFileRead``/``cuFileWrite`` result."""
    if ret < 0:
        raise _map_io_result(ret, err, op, nbytes, file_offset, done, path)
    return ret


# ---------------------------------------------------------------------------------------------
# Loading

cdef struct _Api:
    void* lib
    cf.cuFileDriverOpen_t driver_open
    cf.cuFileDriverClose_t driver_close
    cf.cuFileGetVersion_t get_version
    cf.cuFileHandleRegister_t handle_register
    cf.cuFileHandleDeregister_t handle_deregister
    cf.cuFileBufRegister_t buf_register
    cf.cuFileBufDeregister_t buf_deregister
    cf.cuFileRead_t read
    cf.cuFileWrite_t write

cdef _Api _api          # all NULL until load() succeeds; only written with _lock held

# One lock for the library, the driver count, the registration cache and the config file.
# Reentrant: driver_open() loads, a file registration opens the driver.
_lock = threading.RLock()
_lib_path = None
_driver_count = 0
_driver_config_key = None
_config_file = None     # temporary JSON written by aioswap for the open driver
_saved_env = {}         # variables aioswap set -> the value they had before (None: unset)
_private = None         # private temporary directory (config, cuFile log)
_registrations = {}     # registration key -> _Registration


cdef void* _sym(void* lib, const char* name) noexcept:
    dlerror()
    return dlsym(lib, name)


cdef str _dlerror(str fallback):
    cdef const char* msg = dlerror()
    return fallback if msg == NULL else msg.decode("utf-8", "replace")


cdef object _open_library(str candidate):
    """dlopen ``candidate`` and resolve the entry points into ``_api``; None or why not."""
    cdef bytes bname = os.fsencode(candidate)
    cdef const char* cname = bname
    cdef void* lib
    cdef _Api a
    cdef Dl_info info
    global _api, _lib_path
    memset(&a, 0, sizeof(_Api))
    dlerror()
    with nogil:
        lib = dlopen(cname, RTLD_NOW | RTLD_LOCAL)
    if lib == NULL:
        msg = _dlerror("dlopen failed")
        return msg if candidate in msg else f"{candidate}: {msg}"
    a.lib = lib
    a.driver_open = <cf.cuFileDriverOpen_t>_sym(lib, b"cuFileDriverOpen")
    a.driver_close = <cf.cuFileDriverClose_t>_sym(lib, b"cuFileDriverClose_v2")
    close_name = "cuFileDriverClose_v2"
    if a.driver_close == NULL:
        a.driver_close = <cf.cuFileDriverClose_t>_sym(lib, b"cuFileDriverClose")
        close_name = "cuFileDriverClose"
    a.get_version = <cf.cuFileGetVersion_t>_sym(lib, b"cuFileGetVersion")    # optional
    a.handle_register = <cf.cuFileHandleRegister_t>_sym(lib, b"cuFileHandleRegister")
    a.handle_deregister = <cf.cuFileHandleDeregister_t>_sym(lib, b"cuFileHandleDeregister")
    a.buf_register = <cf.cuFileBufRegister_t>_sym(lib, b"cuFileBufRegister")
    a.buf_deregister = <cf.cuFileBufDeregister_t>_sym(lib, b"cuFileBufDeregister")
    a.read = <cf.cuFileRead_t>_sym(lib, b"cuFileRead")
    a.write = <cf.cuFileWrite_t>_sym(lib, b"cuFileWrite")
    missing = [name for name, ok in (
        ("cuFileDriverOpen", a.driver_open != NULL),
        ("cuFileDriverClose_v2 or cuFileDriverClose", a.driver_close != NULL),
        ("cuFileHandleRegister", a.handle_register != NULL),
        ("cuFileHandleDeregister", a.handle_deregister != NULL),
        ("cuFileBufRegister", a.buf_register != NULL),
        ("cuFileBufDeregister", a.buf_deregister != NULL),
        ("cuFileRead", a.read != NULL),
        ("cuFileWrite", a.write != NULL)) if not ok]
    if missing:
        dlclose(lib)
        return f"{candidate}: loaded but lacks {', '.join(missing)} (not a cuFile library?)"
    where = candidate
    if dladdr(<void*>a.driver_open, &info) != 0 and info.dli_fname != NULL:
        where = os.path.abspath(os.fsdecode(<bytes>info.dli_fname))
    _api = a
    _lib_path = where
    _log.debug("cuFile loaded from %s (driver close: %s)", where, close_name)
    return None


def _wheel_candidates():
    """libcufile from NVIDIA wheels (nvidia/cufile/lib, nvidia/cu13/lib...) on sys.path."""
    found = []
    seen = set()
    for entry in sys.path:
        if not entry:           # "" is the current directory: never load code from it
            continue
        root = os.path.join(os.path.abspath(entry), "nvidia")
        if not os.path.isdir(root):
            continue
        hits = glob.glob(os.path.join(root, "*", "lib", "libcufile.so*"))
        hits.sort(reverse=True)         # nvidia/cufile, then nvidia/cu13 before nvidia/cu12
        hits.sort(key=lambda p: not p.endswith(".so.0"))     # the soname first (stable)
        for p in hits:
            real = os.path.realpath(p)
            if real not in seen:
                seen.add(real)
                found.append(p)
    return found


def _system_candidates():
    """libcufile.so.0 in the CUDA toolkit and conda locations that exist."""
    dirs = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            dirs.append(os.path.join(os.environ[var], "lib64"))
    if os.environ.get("CONDA_PREFIX"):
        dirs.append(os.path.join(os.environ["CONDA_PREFIX"], "lib"))
    dirs.append("/usr/local/cuda/lib64")
    out = []
    for d in dirs:
        p = os.path.join(os.path.abspath(os.path.expanduser(d)), "libcufile.so.0")
        if os.path.exists(p) and p not in out:
            out.append(p)
    return out


cdef str _expand_lib(str value):
    """A path is made absolute (``~`` expanded); a bare name is left to the loader's search."""
    value = os.path.expanduser(value)
    return os.path.abspath(value) if "/" in value else value


def _private_dir():
    """The process's private temporary directory for cuFile's config and log (mode 0700)."""
    global _private
    if _private is None or not os.path.isdir(_private):
        _private = os.path.abspath(tempfile.mkdtemp(prefix="aioswap-cufile-"))
    return _private


def _set_env(str name, str value):
    if name not in _saved_env:
        _saved_env[name] = os.environ.get(name)
    os.environ[name] = value


def _restore_env(str name):
    if name in _saved_env:
        old = _saved_env.pop(name)
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _cleanup_private():
    """Remove aioswap's config file, an empty cuFile log and the directory when empty."""
    global _private, _config_file
    if _config_file is not None:
        try:
            os.unlink(_config_file)
        except OSError:
            pass
        _config_file = None
    if _private is None:
        return
    logfile = os.path.join(_private, "cufile.log")
    try:
        if os.path.getsize(logfile) == 0:
            os.unlink(logfile)
    except OSError:
        pass
    try:
        os.rmdir(_private)
        _private = None
    except OSError:
        pass        # cuFile logged something: keep it for the user


atexit.register(_cleanup_private)


def load(path=None):
    """Load libcufile (once, thread-safe) and return the path it was loaded from.

    Parameters
    ----------
    path : str or os.PathLike, optional
        The library to load. By default ``$AIOSWAP_CUFILE_LIB`` when set (and then only that),
        else ``libcufile.so.0`` and ``libcufile.so`` through the dynamic loader's search, then
        ``nvidia/*/lib/libcufile.so*`` of the NVIDIA wheels (``nvidia-cufile-cu12``, or
        ``nvidia/cu13``) in every ``sys.path`` entry, then ``$CUDA_HOME/lib64``,
        ``$CUDA_PATH/lib64``, ``$CONDA_PREFIX/lib`` and ``/usr/local/cuda/lib64``.

    Returns
    -------
    str
        Absolute path of the loaded library.

    Raises
    ------
    CuFileUnavailable
        No candidate could be loaded, or none exports the cuFile entry points; the message
        names every place tried with the loader's reason.
    RuntimeError
        ``path`` names another library than the one already loaded.

    Notes
    -----
    Importing this module never loads anything; only the first call that needs cuFile does.
    A library is never unloaded. Unless ``CUFILE_LOGFILE_PATH`` is set, it is pointed at a
    private temporary directory before loading, so cuFile writes no ``cufile.log`` into the
    current directory.
    """
    with _lock:
        if path is not None:
            want = _expand_lib(os.fsdecode(path))
        if _api.lib != NULL:
            if (path is not None and "/" in want
                    and os.path.realpath(want) != os.path.realpath(_lib_path)):
                raise RuntimeError(f"cuFile is already loaded from {_lib_path}; cannot load "
                                   f"{want} as well")
            return _lib_path
        from_env = False
        if path is not None:
            candidates = [want]
        elif os.environ.get(LIB_ENV):
            candidates = [_expand_lib(os.environ[LIB_ENV])]
            from_env = True
        else:
            candidates = list(SONAMES) + _wheel_candidates() + _system_candidates()
        set_log = not os.environ.get("CUFILE_LOGFILE_PATH")
        if set_log:
            _set_env("CUFILE_LOGFILE_PATH", os.path.join(_private_dir(), "cufile.log"))
        failures = []
        for cand in candidates:
            why = _open_library(cand)
            if why is None:
                return _lib_path
            failures.append(why)
        if set_log:
            _restore_env("CUFILE_LOGFILE_PATH")
            _cleanup_private()
        raise CuFileUnavailable(_unavailable_message(failures, path is not None, from_env))


cdef str _unavailable_message(list failures, bint explicit, bint from_env):
    tried = "; ".join(failures)
    if explicit:
        return f"cuFile (GPUDirect Storage) is unavailable: cannot load libcufile: {tried}"
    if from_env:
        return (f"cuFile (GPUDirect Storage) is unavailable: {LIB_ENV}="
                f"{os.environ.get(LIB_ENV)} cannot be loaded: {tried}. Point {LIB_ENV} at "
                f"libcufile.so.0, or unset it to search the usual places")
    if not any("nvidia" in f for f in failures):
        tried += "; no nvidia/*/lib/libcufile.so* in any sys.path entry"
    return (f"cuFile (GPUDirect Storage) is unavailable: libcufile was not found. Tried: "
            f"{tried}. Install NVIDIA's cuFile wheel (pip install nvidia-cufile-cu12; CUDA "
            f"builds of torch depend on it) or set {LIB_ENV} to the library's path")


def available(bint check_driver=False):
    """Return ``(True, library_path)`` when cuFile can be used, else ``(False, reason)``.

    Parameters
    ----------
    check_driver : bool
        Also open (and close again) the cuFile driver, which needs a GPU and its driver;
        by default only the library is loaded.

    Never raises.
    """
    try:
        where = load()
        if check_driver:
            driver_open()
            driver_close()
    except Exception as exc:
        return (False, str(exc))
    return (True, where)


def library_path():
    """Return the path libcufile was loaded from, or None when it is not loaded (yet)."""
    return _lib_path


def version():
    """Return ``cuFileGetVersion()`` (e.g. 1140 for cuFile 1.14), or None where the library
    does not export it.

    Raises
    ------
    CuFileUnavailable
        libcufile cannot be loaded.
    CuFileError
        The call failed.
    """
    cdef int v = 0
    cdef cf.CUfileError_t st
    load()
    if _api.get_version == NULL:
        return None
    with nogil:
        st = _api.get_version(&v)
    _check_status(st, "cuFileGetVersion")
    return v


# ---------------------------------------------------------------------------------------------
# Driver

def _config_key(config):
    if isinstance(config, Mapping):
        return ("json", json.dumps(config, sort_keys=True, default=str))
    return ("path", os.path.abspath(os.path.expanduser(os.fsdecode(config))))


def _write_config(config):
    """Write a config mapping to a private temporary file; return its absolute path."""
    fd, name = tempfile.mkstemp(prefix="aioswap-cufile-", suffix=".json", dir=_private_dir())
    name = os.path.abspath(name)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(dict(config), f, indent=1)
    except BaseException:
        os.unlink(name)
        raise
    return name


def driver_open(config=None):
    """Open the cuFile driver for one more user (``cuFileDriverOpen`` for the first).

    Parameters
    ----------
    config : Mapping or str or os.PathLike, optional
        cuFile configuration for the first open: a mapping in ``cufile.json``'s schema, which
        is written to a file in a private temporary directory, or the path of a JSON file.
        Either way ``CUFILE_ENV_PATH_JSON`` is set to its fully expanded absolute path while
        the driver is open. Without a config, a relative or ``~`` value of
        ``CUFILE_ENV_PATH_JSON`` is expanded; else cuFile uses its own defaults.

    Raises
    ------
    CuFileUnavailable
        libcufile cannot be loaded, or the driver does not open (no GPU, no CUDA driver,
        platform not supported...); the cause is the :class:`CuFileError` with cuFile's code.
    ValueError
        The driver is already open with another config.
    FileNotFoundError
        ``config`` names a file that does not exist.
    """
    cdef cf.CUfileError_t st
    global _driver_count, _driver_config_key, _config_file
    with _lock:
        if _driver_count > 0:
            if config is not None and _config_key(config) != _driver_config_key:
                raise ValueError("the cuFile driver is already open with another config; "
                                 "a config applies only to the first driver_open()")
            _driver_count += 1
            return
        load()
        owned = None
        key = None
        if config is not None:
            key = _config_key(config)
            if key[0] == "json":
                owned = cfg = _write_config(config)
            else:
                cfg = key[1]
                if not os.path.isfile(cfg):
                    raise FileNotFoundError(f"cuFile config {cfg!r} does not exist")
            _set_env("CUFILE_ENV_PATH_JSON", cfg)
        else:
            user = os.environ.get("CUFILE_ENV_PATH_JSON")
            if user and (not os.path.isabs(user) or user.startswith("~")):
                _set_env("CUFILE_ENV_PATH_JSON", os.path.abspath(os.path.expanduser(user)))
        _config_file = owned
        with nogil:
            st = _api.driver_open()
        try:
            _check_status(st, "cuFileDriverOpen")
        except CuFileError as exc:
            _forget_config()
            raise CuFileUnavailable(f"cuFile (GPUDirect Storage) is unavailable: the cuFile "
                                    f"driver does not open ({exc.strerror}); a GPU, its driver "
                                    f"and a supported platform are needed") from exc
        _driver_count = 1
        _driver_config_key = key


def _forget_config():
    global _config_file, _driver_config_key
    _restore_env("CUFILE_ENV_PATH_JSON")
    if _config_file is not None:
        try:
            os.unlink(_config_file)
        except OSError:
            pass
        _config_file = None
    _driver_config_key = None


def driver_close():
    """Release one :func:`driver_open`; the last release calls ``cuFileDriverClose``.

    Raises
    ------
    RuntimeError
        No matching :func:`driver_open`.
    CuFileError
        ``cuFileDriverClose`` failed (the driver counts as closed all the same).
    """
    cdef cf.CUfileError_t st
    global _driver_count
    with _lock:
        if _driver_count == 0:
            raise RuntimeError("driver_close() without a matching driver_open()")
        _driver_count -= 1
        if _driver_count > 0:
            return
        with nogil:
            st = _api.driver_close()
        _forget_config()
        _check_status(st, "cuFileDriverClose")


def driver_users():
    """Return how many users hold the cuFile driver open (0: closed)."""
    return _driver_count


cdef class Driver:
    """Holds the cuFile driver open from construction to :meth:`close`; a context manager.

    Parameters
    ----------
    config : Mapping or str or os.PathLike, optional
        Passed to :func:`driver_open`.
    """
    cdef bint _open

    def __cinit__(self):
        self._open = False

    def __init__(self, config=None):
        if self._open:
            raise RuntimeError("Driver is already initialised")
        driver_open(config)
        self._open = True

    def close(self):
        """Release this reference to the driver. Idempotent."""
        if self._open:
            self._open = False
            driver_close()

    @property
    def closed(self):
        return not self._open

    def __enter__(self):
        if not self._open:
            raise HandleClosedError("cuFile Driver is closed")
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<aioswap._cufile.Driver {'closed' if not self._open else 'open'}>"

    def __dealloc__(self):
        if self._open:
            self._open = False
            try:
                driver_close()
            except BaseException:
                pass
            _warn_unclosed("aioswap._cufile.Driver")


cdef void _warn_unclosed(str what):
    # Reported as unraisable when warnings are errors, so an unclosed owner fails its test.
    if sys is not None and not sys.is_finalizing():
        warnings.warn(f"unclosed {what}", ResourceWarning, stacklevel=2)


# ---------------------------------------------------------------------------------------------
# Device ranges

class DeviceRangeRegistry:
    """Sorted, non-overlapping device address ranges ``[start, end)``, each with an owner.

    Lookups take no lock: they bisect an immutable snapshot that writers replace whole.
    """

    def __init__(self):
        self._write_lock = threading.Lock()
        self._snap = ((), (), ())      # starts, ends, owners

    def add(self, ptr, nbytes, owner=None):
        """Record ``[ptr, ptr + nbytes)``.

        Raises
        ------
        ValueError
            ``ptr`` <= 0, ``nbytes`` <= 0, or the range overlaps a recorded one.
        """
        start = operator.index(ptr)
        n = operator.index(nbytes)
        if start <= 0:
            raise ValueError(f"invalid device address {start:#x}")
        if n <= 0:
            raise ValueError(f"device range needs a positive size, got {n}")
        end = start + n
        with self._write_lock:
            starts, ends, owners = self._snap
            i = bisect.bisect_right(starts, start)
            for j in (i - 1, i):
                if 0 <= j < len(starts) and starts[j] < end and start < ends[j]:
                    raise ValueError(f"device range [{start:#x}, {end:#x}) overlaps the "
                                     f"registered range [{starts[j]:#x}, {ends[j]:#x})")
            self._snap = (starts[:i] + (start,) + starts[i:], ends[:i] + (end,) + ends[i:],
                          owners[:i] + (owner,) + owners[i:])

    def remove(self, ptr):
        """Forget the range starting at ``ptr``; return its size.

        Raises
        ------
        ValueError
            No recorded range starts at ``ptr``.
        """
        start = operator.index(ptr)
        with self._write_lock:
            starts, ends, owners = self._snap
            i = bisect.bisect_left(starts, start)
            if i == len(starts) or starts[i] != start:
                raise ValueError(f"no registered device range starts at {start:#x}")
            n = ends[i] - start
            self._snap = (starts[:i] + starts[i + 1:], ends[:i] + ends[i + 1:],
                          owners[:i] + owners[i + 1:])
        return n

    def find(self, ptr, nbytes=1):
        """Return ``(start, end)`` of the range holding all of ``[ptr, ptr + nbytes)``, or None.

        A zero ``nbytes`` asks whether ``ptr`` itself lies in a range.
        """
        p = operator.index(ptr)
        n = operator.index(nbytes)
        if n < 0:
            raise ValueError(f"negative size {n}")
        starts, ends, _ = self._snap
        i = bisect.bisect_right(starts, p) - 1
        if i >= 0 and p < ends[i] and p + n <= ends[i]:
            return (starts[i], ends[i])
        return None

    def overlapping(self, ptr, nbytes):
        """Return the ``(start, end)`` of every range that overlaps ``[ptr, ptr + nbytes)``."""
        p = operator.index(ptr)
        end = p + operator.index(nbytes)
        starts, ends, _ = self._snap
        i = max(bisect.bisect_right(starts, p) - 1, 0)
        out = []
        while i < len(starts) and starts[i] < end:
            if ends[i] > p:
                out.append((starts[i], ends[i]))
            i += 1
        return out

    def owner(self, ptr):
        """Return the owner recorded with the range starting at ``ptr``."""
        start = operator.index(ptr)
        starts, _, owners = self._snap
        i = bisect.bisect_left(starts, start)
        if i == len(starts) or starts[i] != start:
            raise ValueError(f"no registered device range starts at {start:#x}")
        return owners[i]

    def ranges(self):
        """Return every ``(start, end)``, sorted."""
        starts, ends, _ = self._snap
        return list(zip(starts, ends))

    def __len__(self):
        return len(self._snap[0])

    def __contains__(self, ptr):
        return self.find(ptr, 0) is not None

    def __repr__(self):
        return f"<aioswap._cufile.DeviceRangeRegistry {len(self)} ranges>"


_ranges = DeviceRangeRegistry()


def registered_range(ptr, nbytes=1):
    """Return ``(start, end)`` of the :func:`buf_register`-ed range holding
    ``[ptr, ptr + nbytes)``, or None."""
    return _ranges.find(ptr, nbytes)


def buf_register(ptr, nbytes, int flags=0, owner=None):
    """Register device memory ``[ptr, ptr + nbytes)`` with cuFile (``cuFileBufRegister``).

    Parameters
    ----------
    ptr : int
        Device address, the base that I/O on this memory will be issued against.
    nbytes : int
        Size in bytes (> 0).
    flags : int
        ``cuFileBufRegister`` flags (0).
    owner : object, optional
        Kept referenced until :func:`buf_deregister`, so the memory outlives its registration.

    Raises
    ------
    ValueError
        Bad address or size, or the range overlaps one already registered.
    CuFileUnavailable
        libcufile or the driver is unavailable.
    CuFileError
        cuFile refused the registration.

    Notes
    -----
    A registration holds a driver reference. :class:`CuFileHandle` I/O on any address inside
    a registered range is issued as ``(start, offset)``, as cuFile requires.
    """
    cdef cf.CUfileError_t st
    cdef const void* p
    cdef size_t n
    start = operator.index(ptr)
    size = operator.index(nbytes)
    if start <= 0:
        raise ValueError(f"invalid device address {start:#x}")
    if size <= 0:
        raise ValueError(f"buf_register needs a positive size, got {size}")
    with _lock:
        hit = _ranges.overlapping(start, size)
        if hit:
            raise ValueError(f"device range [{start:#x}, {start + size:#x}) overlaps the "
                             f"registered range [{hit[0][0]:#x}, {hit[0][1]:#x})")
        driver_open()
        p = <const void*><uintptr_t>start
        n = <size_t>size
        try:
            with nogil:
                st = _api.buf_register(p, n, flags)
            _check_status(st, f"cuFileBufRegister({start:#x}, {size})")
        except BaseException:
            driver_close()
            raise
        _ranges.add(start, size, owner)


def buf_deregister(ptr):
    """Deregister the range that :func:`buf_register` registered at ``ptr``.

    Raises
    ------
    ValueError
        No range was registered at ``ptr``.
    CuFileError
        cuFile refused; the range stays registered.
    """
    cdef cf.CUfileError_t st
    cdef const void* p
    start = operator.index(ptr)
    with _lock:
        _ranges.owner(start)            # ValueError when not registered here
        p = <const void*><uintptr_t>start
        with nogil:
            st = _api.buf_deregister(p)
        _check_status(st, f"cuFileBufDeregister({start:#x})")
        _ranges.remove(start)
        driver_close()


# ---------------------------------------------------------------------------------------------
# Files

cdef class _Registration:
    """One ``cuFileHandleRegister`` of one open file, shared by the handles on it."""
    cdef cf.CUfileHandle_t fh
    cdef object key
    cdef int fd
    cdef bint owns_fd
    cdef int users

    def __cinit__(self):
        self.fh = NULL
        self.fd = -1
        self.owns_fd = False
        self.users = 0


cdef _Registration _acquire(object key, int fd, bint owns_fd, object path):
    """Share the registration of ``key``, or register ``fd`` (taking a driver reference)."""
    cdef _Registration reg
    cdef cf.CUfileDescr_t descr
    cdef cf.CUfileHandle_t fh = NULL
    cdef cf.CUfileError_t st
    with _lock:
        reg = _registrations.get(key)
        if reg is not None:
            reg.users += 1
            return reg
        driver_open()
        memset(&descr, 0, sizeof(descr))
        descr.type = cf.CU_FILE_HANDLE_TYPE_OPAQUE_FD
        descr.handle.fd = fd
        descr.fs_ops = NULL
        try:
            with nogil:
                st = _api.handle_register(&fh, &descr)
            _check_status(st, f"cuFileHandleRegister({fd if path is None else path!r})")
        except BaseException:
            driver_close()
            raise
        reg = _Registration()
        reg.fh = fh
        reg.key = key
        reg.fd = fd
        reg.owns_fd = owns_fd
        reg.users = 1
        _registrations[key] = reg
        return reg


cdef void _release(_Registration reg) except *:
    """Drop one user; the last deregisters, closes an owned fd and releases the driver."""
    cdef cf.CUfileHandle_t fh
    with _lock:
        reg.users -= 1
        if reg.users > 0:
            return
        _registrations.pop(reg.key, None)
        fh = reg.fh
        reg.fh = NULL
        with nogil:
            _api.handle_deregister(fh)
        try:
            if reg.owns_fd:
                os.close(reg.fd)
        finally:
            driver_close()


cdef struct _Io:
    cf.cuFileRead_t read_fn
    cf.cuFileWrite_t write_fn
    cf.CUfileHandle_t fh
    void* base
    size_t size
    off_t file_offset
    off_t buf_offset
    size_t done
    ssize_t ret
    int err
    bint is_write
    bint overrun


cdef void _io_run(_Io* r) noexcept nogil:
    """Call cuFileRead/cuFileWrite until done, an error, no progress, or a bad count."""
    cdef ssize_t ret
    cdef size_t left
    while r.done < r.size:
        left = r.size - r.done
        cerrno.errno = 0        # so that -1 without errno is told apart from a stale one
        if r.is_write:
            ret = r.write_fn(r.fh, r.base, left, r.file_offset + <off_t>r.done,
                             r.buf_offset + <off_t>r.done)
        else:
            ret = r.read_fn(r.fh, r.base, left, r.file_offset + <off_t>r.done,
                            r.buf_offset + <off_t>r.done)
        r.ret = ret
        if ret < 0:
            r.err = cerrno.errno if ret == -1 else 0
            return
        if ret == 0:
            return
        if <size_t>ret > left:
            r.overrun = True
            return
        r.done += <size_t>ret


cdef class CuFileHandle:
    """A file registered with cuFile (``cuFileHandleRegister``) for device-memory I/O.

    Parameters
    ----------
    file : str, bytes, os.PathLike or int
        A path, opened here (and closed by :meth:`close`), or an open fd that stays the
        caller's to close, after this handle.
    write : bool
        Open the path for reading and writing (``O_RDWR``); else read-only.
    create, truncate : bool
        ``O_CREAT`` / ``O_TRUNC`` when opening a path.
    direct : bool
        Open the path with ``O_DIRECT``, which GPUDirect Storage needs for the direct path
        (cuFile's compatibility mode works without it).
    mode : int
        Permissions of a created file.

    Raises
    ------
    CuFileUnavailable
        libcufile or the driver is unavailable.
    CuFileError
        ``cuFileHandleRegister`` failed.
    DirectIOUnsupportedError
        ``direct=True`` and the file system refuses ``O_DIRECT``.

    Notes
    -----
    Handles on the same open file (the same path opened with the same access, or the same
    fd) share one registration, counted; the last :meth:`close` deregisters it. A handle
    holds a driver reference through its registration. Device memory passed by address must
    stay alive until the call returns; calls are synchronous.
    """
    cdef _Registration _reg
    cdef cf.CUfileHandle_t _fh
    cdef int _fd
    cdef bint _open
    cdef bint _readable
    cdef bint _writable
    cdef int _busy
    cdef object _path

    def __cinit__(self):
        self._reg = None
        self._fh = NULL
        self._fd = -1
        self._open = False
        self._readable = False
        self._writable = False
        self._busy = 0
        self._path = None

    def __init__(self, file, *, bint write=False, bint create=False, bint truncate=False,
                 bint direct=True, int mode=0o644):
        cdef int fd
        cdef bint owns
        if self._open:
            raise RuntimeError("CuFileHandle is already initialised")
        load()
        if isinstance(file, int):
            if create or truncate:
                raise ValueError("create/truncate apply to a path, not to an open fd")
            fd = file
            owns = False
            st = os.fstat(fd)
            acc = fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_ACCMODE", 3)
            self._readable = acc in (os.O_RDONLY, os.O_RDWR)
            self._writable = acc in (os.O_WRONLY, os.O_RDWR)
            key = ("fd", fd, st.st_dev, st.st_ino)
        else:
            self._path = os.fsdecode(file)
            fd = _open_file(self._path, write, create, truncate, direct, mode)
            owns = True
            try:
                st = os.fstat(fd)
            except BaseException:
                os.close(fd)
                raise
            self._readable = True
            self._writable = write
            key = ("path", st.st_dev, st.st_ino, write, direct)
        try:
            reg = _acquire(key, fd, owns, self._path)
        except BaseException:
            if owns:
                os.close(fd)
            raise
        if owns and reg.fd != fd:
            os.close(fd)        # shared: the registration's own fd serves this handle
        self._reg = reg
        self._fh = reg.fh
        self._fd = reg.fd
        self._open = True

    def close(self):
        """Release this handle's share of the registration. Idempotent.

        Raises
        ------
        RuntimeError
            A read or write is running on this handle in another thread.
        """
        if self._busy:
            raise RuntimeError("CuFileHandle.close() while I/O is running on it")
        if self._open:
            self._open = False
            reg = self._reg
            self._reg = None
            self._fh = NULL
            _release(reg)

    def __dealloc__(self):
        if self._open:
            self._open = False
            try:
                _release(self._reg)
            except BaseException:
                pass
            self._reg = None
            _warn_unclosed(f"aioswap._cufile.CuFileHandle ({self._path or self._fd})")

    @property
    def closed(self):
        return not self._open

    @property
    def path(self):
        """The path this handle opened, or None for a caller's fd."""
        return self._path

    @property
    def readable(self):
        return self._readable

    @property
    def writable(self):
        return self._writable

    def fileno(self):
        """The registered fd (shared with other handles on the same file)."""
        self._ensure_open()
        return self._fd

    def __enter__(self):
        self._ensure_open()
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        if not self._open:
            return "<aioswap._cufile.CuFileHandle closed>"
        what = repr(self._path) if self._path is not None else f"fd={self._fd}"
        return f"<aioswap._cufile.CuFileHandle {what}{' rw' if self._writable else ''}>"

    cdef _ensure_open(self):
        if not self._open:
            raise HandleClosedError("I/O on a closed CuFileHandle")

    def read(self, dev_ptr, nbytes, file_offset=0, buf_offset=0):
        """Read ``nbytes`` at ``file_offset`` into ``dev_ptr + buf_offset``; return ``nbytes``.

        Parameters
        ----------
        dev_ptr : int
            Device address (or, with cuFile's compatibility, any address cuFile accepts).
        nbytes : int
            Bytes to read (>= 0).
        file_offset, buf_offset : int
            Offsets (>= 0) into the file and into the memory at ``dev_ptr``.

        Raises
        ------
        ShortReadError
            The file ended first.
        CuFileError
            cuFile failed: ``errno`` is the errno or the ``CU_FILE_*`` code.

        Notes
        -----
        Short counts are continued until all bytes moved. When the target lies inside a
        :func:`buf_register`-ed range, the call is issued against the range's start with the
        matching offset.
        """
        return self._io(False, dev_ptr, nbytes, file_offset, buf_offset)

    def write(self, dev_ptr, nbytes, file_offset=0, buf_offset=0):
        """Write ``nbytes`` from ``dev_ptr + buf_offset`` at ``file_offset``; return ``nbytes``.

        Same parameters and notes as :meth:`read`.

        Raises
        ------
        CuFileError
            cuFile failed, or a call made no progress (``EIO``).
        io.UnsupportedOperation
            The file is not open for writing.
        """
        return self._io(True, dev_ptr, nbytes, file_offset, buf_offset)

    cdef object _io(self, bint is_write, object dev_ptr, object nbytes, object file_offset,
                    object buf_offset):
        cdef _Io r
        self._ensure_open()
        op = "cuFileWrite" if is_write else "cuFileRead"
        ptr = operator.index(dev_ptr)
        n = operator.index(nbytes)
        foff = operator.index(file_offset)
        boff = operator.index(buf_offset)
        if n < 0 or foff < 0 or boff < 0:
            raise ValueError(f"{op}: negative size or offset (nbytes={n}, file_offset={foff}, "
                             f"buf_offset={boff})")
        if is_write and not self._writable:
            raise io.UnsupportedOperation(f"{op}: the file is not open for writing"
                                          f"{_in(self._path)}")
        if not is_write and not self._readable:
            raise io.UnsupportedOperation(f"{op}: the file is not open for reading"
                                          f"{_in(self._path)}")
        if n == 0:
            return 0
        if ptr <= 0:
            raise ValueError(f"{op}: invalid buffer address {ptr:#x}")
        addr = ptr + boff
        hit = _ranges.find(addr, n)
        if hit is not None:
            base, boff = hit[0], addr - hit[0]
        else:
            base = ptr
        memset(&r, 0, sizeof(_Io))
        r.read_fn = _api.read
        r.write_fn = _api.write
        r.fh = self._fh
        r.base = <void*><uintptr_t>base
        r.size = <size_t>n
        r.file_offset = <off_t>foff
        r.buf_offset = <off_t>boff
        r.is_write = is_write
        self._busy += 1
        try:
            while True:
                with nogil:
                    _io_run(&r)
                if r.done == r.size:
                    return n
                if r.ret == -1 and r.err == EINTR:
                    PyErr_CheckSignals()
                    continue
                break
        finally:
            self._busy -= 1
        _check_io(r.ret, r.err, op, r.size, r.file_offset, r.done, self._path)
        if r.overrun:
            raise CuFileError(EIO, f"{op} of {n} bytes at file offset {foff}: cuFile reported "
                                   f"{r.ret} bytes for a call of {n - r.done} "
                                   f"({r.done} bytes done)")
        if is_write:
            raise CuFileError(EIO, f"{op} of {n} bytes at file offset {foff}: no progress at "
                                   f"offset {foff + r.done} ({r.done} bytes done)")
        raise ShortReadError(
            f"{op} of {n} bytes at file offset {foff}{_in(self._path)} reached end of file at "
            f"offset {foff + r.done} ({r.done} bytes read)",
            path=self._path, offset=foff, nbytes=n, file_size=_fd_size(self._fd))


cdef int _open_file(str path, bint write, bint create, bint truncate, bint direct,
                    int mode) except -1:
    flags = os.O_CLOEXEC | (os.O_RDWR if write else os.O_RDONLY)
    if create:
        flags |= os.O_CREAT
    if truncate:
        flags |= os.O_TRUNC
    if not direct:
        return os.open(path, flags, mode)
    existed = os.path.lexists(path) if create else True
    try:
        return os.open(path, flags | os.O_DIRECT, mode)
    except OSError as exc:
        if exc.errno != EINVAL:
            raise
        if not existed:
            try:
                os.unlink(path)
            except OSError:
                pass
        raise DirectIOUnsupportedError(exc.errno, f"the file system refuses O_DIRECT for "
                                                  f"{path!r}", path) from None


cdef str _in(object path):
    return "" if path is None else f" ({path!r})"


cdef object _fd_size(int fd):
    try:
        return os.fstat(fd).st_size
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------
# Test support

def _state():
    """Counts of what is loaded and held, for tests and diagnostics."""
    return {"loaded": _api.lib != NULL, "driver_users": _driver_count,
            "registrations": sum((<_Registration>r).users for r in _registrations.values()),
            "files": len(_registrations), "buffers": len(_ranges)}


def _unload():
    """Forget the loaded library (tests only), so the next use loads again; refuses while
    anything is open or registered."""
    global _lib_path
    with _lock:
        if _driver_count or _registrations or len(_ranges):
            raise RuntimeError(f"cuFile is in use: {_state()}")
        # Forget the entry points but leave the library mapped: libraries like cuFile may
        # keep threads or atexit handlers that would run in unmapped code.
        memset(&_api, 0, sizeof(_Api))
        _lib_path = None
        _restore_env("CUFILE_LOGFILE_PATH")
        _cleanup_private()
