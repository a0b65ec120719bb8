"""aioswap._cufile and its policy (_cufile_load): loader, environment, errors, cuFile I/O.

Without CUDA the real library is replaced by a fake libcufile built here with gcc: it exports
the cufile.h entry points with their real signatures and serves them with pread/pwrite on host
memory, so loading, driver reference counting, registration sharing, short counts and error
mapping are exercised for real. Knobs and call counters are globals of the fake, read and set
with ctypes. Tests that need a GPU and the real library carry the ``cufile`` marker and skip
with the reason.
"""
from __future__ import annotations

import ast
import ctypes
import errno
import gc
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioswap
from aioswap import _cufile, pinned
from aioswap import _cufile_load as policy
from aioswap._cufile import CuFileHandle, Driver
from aioswap.errors import (CuFileError, CuFileUnavailable, DirectIOUnsupportedError,
                            HandleClosedError, ShortReadError)

FAKE_SRC = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>
#include <unistd.h>

/* The cufile.h types, with the layouts of the real header. */
typedef struct { int err; int cu_err; } CUfileError_t;
typedef struct {
    int type;
    union { int fd; void *handle; } handle;
    const void *fs_ops;
} CUfileDescr_t;
typedef void *CUfileHandle_t;

int fake_open_calls, fake_close_calls, fake_close_v1_calls, fake_driver_is_open;
int fake_register_calls, fake_deregister_calls, fake_handles_open;
int fake_buf_register_calls, fake_buf_deregister_calls, fake_bufs_open, fake_last_flags;
int fake_read_calls, fake_write_calls;
int fake_open_error, fake_open_cu_err, fake_register_error, fake_buf_register_error;
int fake_buf_deregister_error;
long fake_max_io;
int fake_fail_errno, fake_fail_code, fake_fail_after, fake_fail_times;
int fake_zero_write, fake_overrun;
long long fake_last_base, fake_last_buf_offset, fake_last_file_offset, fake_last_size;
char fake_config_path[4096], fake_config_text[4096], fake_logfile_path[4096];

static CUfileError_t status(int err, int cu_err) { CUfileError_t s = {err, cu_err}; return s; }

CUfileError_t cuFileDriverOpen(void) {
    const char *p;
    fake_open_calls++;
    fake_config_path[0] = fake_config_text[0] = fake_logfile_path[0] = 0;
    p = getenv("CUFILE_ENV_PATH_JSON");
    if (p) {
        FILE *f = fopen(p, "r");
        snprintf(fake_config_path, sizeof fake_config_path, "%s", p);
        if (f) {
            size_t n = fread(fake_config_text, 1, sizeof fake_config_text - 1, f);
            fake_config_text[n] = 0;
            fclose(f);
        }
    }
    p = getenv("CUFILE_LOGFILE_PATH");
    if (p) snprintf(fake_logfile_path, sizeof fake_logfile_path, "%s", p);
    if (fake_open_error) return status(fake_open_error, fake_open_cu_err);
    if (fake_driver_is_open) return status(5026, 0);        /* DRIVER_ALREADY_OPEN */
    fake_driver_is_open = 1;
    return status(0, 0);
}

static CUfileError_t driver_close(void) {
    if (!fake_driver_is_open) return status(5001, 0);
    if (fake_handles_open || fake_bufs_open) return status(5030, 0);
    fake_driver_is_open = 0;
    return status(0, 0);
}
#ifndef NO_V2
CUfileError_t cuFileDriverClose_v2(void) { fake_close_calls++; return driver_close(); }
#endif
CUfileError_t cuFileDriverClose(void) { fake_close_v1_calls++; return driver_close(); }

#ifndef NO_VERSION
CUfileError_t cuFileGetVersion(int *version) { *version = 1140; return status(0, 0); }
#endif

struct fake_handle { int fd; };

CUfileError_t cuFileHandleRegister(CUfileHandle_t *fh, CUfileDescr_t *descr) {
    struct fake_handle *h;
    fake_register_calls++;
    if (!fake_driver_is_open) return status(5001, 0);
    if (fake_register_error) return status(fake_register_error, 0);
    if (!fh || !descr || descr->type != 1 || descr->fs_ops != NULL
            || fcntl(descr->handle.fd, F_GETFD) == -1)
        return status(5022, 0);                             /* INVALID_VALUE */
    h = malloc(sizeof *h);
    h->fd = descr->handle.fd;
    *fh = h;
    fake_handles_open++;
    return status(0, 0);
}

void cuFileHandleDeregister(CUfileHandle_t fh) {
    fake_deregister_calls++;
    if (fh) { free(fh); fake_handles_open--; }
}

static const void *bufs[64];

CUfileError_t cuFileBufRegister(const void *base, size_t length, int flags) {
    int i;
    fake_buf_register_calls++;
    fake_last_flags = flags;
    if (!fake_driver_is_open) return status(5001, 0);
    if (fake_buf_register_error) return status(fake_buf_register_error, 0);
    if (!base || !length) return status(5022, 0);
    for (i = 0; i < 64; i++) if (bufs[i] == base) return status(5023, 0);
    for (i = 0; i < 64; i++)
        if (!bufs[i]) { bufs[i] = base; fake_bufs_open++; return status(0, 0); }
    return status(5043, 0);
}

CUfileError_t cuFileBufDeregister(const void *base) {
    int i;
    fake_buf_deregister_calls++;
    if (fake_buf_deregister_error) return status(fake_buf_deregister_error, 0);
    for (i = 0; i < 64; i++)
        if (base && bufs[i] == base) { bufs[i] = 0; fake_bufs_open--; return status(0, 0); }
    return status(5024, 0);                                 /* MEMORY_NOT_REGISTERED */
}

static ssize_t fake_io(int wr, CUfileHandle_t fh, const void *base, size_t size, off_t foff,
                       off_t boff) {
    struct fake_handle *h = fh;
    int n = wr ? ++fake_write_calls : ++fake_read_calls;
    char *p;
    fake_last_base = (long long)(uintptr_t)base;
    fake_last_buf_offset = boff;
    fake_last_file_offset = foff;
    fake_last_size = (long long)size;
    if (!h) return -5027;                                   /* HANDLE_NOT_REGISTERED */
    if (n > fake_fail_after && (!fake_fail_times || n <= fake_fail_after + fake_fail_times)) {
        if (fake_fail_errno) { errno = fake_fail_errno; return -1; }
        if (fake_fail_code) return -(ssize_t)fake_fail_code;
    }
    if (fake_overrun) return (ssize_t)size + 1;
    if (wr && fake_zero_write) return 0;
    if (fake_max_io > 0 && size > (size_t)fake_max_io) size = (size_t)fake_max_io;
    p = (char *)base + boff;
    return wr ? pwrite(h->fd, p, size, foff) : pread(h->fd, p, size, foff);
}

ssize_t cuFileRead(CUfileHandle_t fh, void *base, size_t size, off_t foff, off_t boff) {
    return fake_io(0, fh, base, size, foff, boff);
}

ssize_t cuFileWrite(CUfileHandle_t fh, const void *base, size_t size, off_t foff, off_t boff) {
    return fake_io(1, fh, base, size, foff, boff);
}
"""

_INTS = ("open_calls", "close_calls", "close_v1_calls", "driver_is_open", "register_calls",
         "deregister_calls", "handles_open", "buf_register_calls", "buf_deregister_calls",
         "bufs_open", "last_flags", "read_calls", "write_calls", "open_error", "open_cu_err",
         "register_error", "buf_register_error", "buf_deregister_error", "fail_errno",
         "fail_code", "fail_after",
         "fail_times", "zero_write", "overrun")
_LONGLONGS = ("last_base", "last_buf_offset", "last_file_offset", "last_size")


class Fake:
    """The fake libcufile's globals, through ctypes (the same mapping aioswap dlopen'ed)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.lib = ctypes.CDLL(self.path)

    def _var(self, name: str) -> Any:
        if name in _LONGLONGS:
            return ctypes.c_longlong.in_dll(self.lib, "fake_" + name)
        if name == "max_io":
            return ctypes.c_long.in_dll(self.lib, "fake_max_io")
        assert name in _INTS, name
        return ctypes.c_int.in_dll(self.lib, "fake_" + name)

    def __getitem__(self, name: str) -> int:
        return int(self._var(name).value)

    def __setitem__(self, name: str, value: int) -> None:
        self._var(name).value = value

    def text(self, name: str) -> str:
        return (ctypes.c_char * 4096).in_dll(self.lib, "fake_" + name).value.decode()

    def reset(self) -> None:
        for name in _INTS + _LONGLONGS + ("max_io",):
            if name not in ("driver_is_open", "handles_open", "bufs_open"):
                self[name] = 0


def _gcc(tmp: Path, name: str, source: str, *defines: str) -> Path:
    src = tmp / (name + ".c")
    src.write_text(source)
    out = tmp / ("lib" + name + ".so")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", *defines,
                    "-o", str(out), str(src)], check=True)
    return out


@pytest.fixture(scope="session")
def fake_libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The fake libcufile (and variants) plus a library with no cuFile symbols."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the fake libcufile")
    tmp = tmp_path_factory.mktemp("fakecufile")
    return {
        "full": _gcc(tmp, "fakecufile", FAKE_SRC),
        "v1": _gcc(tmp, "fakecufile_v1", FAKE_SRC, "-DNO_V2"),
        "noversion": _gcc(tmp, "fakecufile_nover", FAKE_SRC, "-DNO_VERSION"),
        "empty": _gcc(tmp, "nocufile", "int unrelated(void) { return 42; }\n"),
    }


@pytest.fixture(autouse=True)
def _clean_cufile(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with nothing loaded and must leave nothing open."""
    for var in ("AIOSWAP_CUFILE_LIB", "CUFILE_ENV_PATH_JSON", "CUFILE_LOGFILE_PATH"):
        monkeypatch.delenv(var, raising=False)
    _cufile._unload()
    yield
    state = _cufile._state()
    assert state["driver_users"] == 0 and state["files"] == 0 and state["buffers"] == 0, state
    _cufile._unload()


def _use(path: Path) -> Fake:
    fake = Fake(path)
    fake.reset()
    assert _cufile.load(str(path)) == str(path)
    return fake


@pytest.fixture
def fake(fake_libs: dict[str, Path]) -> Fake:
    return _use(fake_libs["full"])


def _real_cufile_found() -> bool:
    return _cufile.available()[0]


def _data(n: int) -> np.ndarray:
    return np.frombuffer(os.urandom(n), dtype=np.uint8).copy()


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# ---------------------------------------------------------------------------------------------
# Import and loader


def test_import_loads_nothing() -> None:
    code = ("import os, aioswap, aioswap._cufile as c\n"
            "assert c.library_path() is None\n"
            "assert 'libcufile' not in open('/proc/self/maps').read()\n"
            "assert 'CUFILE_LOGFILE_PATH' not in os.environ\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIOSWAP_", "CUFILE_"))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert aioswap.CuFileUnavailable is CuFileUnavailable


def test_available_never_raises() -> None:
    ok, reason = _cufile.available()
    assert isinstance(ok, bool)
    if ok:
        assert reason == _cufile.library_path()
    else:
        assert "libcufile" in reason
        assert _cufile.library_path() is None


def test_load_names_every_place_tried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if _real_cufile_found():
        pytest.skip("a real libcufile is installed here")
    # a broken wheel layout is named with the loader's reason
    bogus = tmp_path / "site" / "nvidia" / "cu13" / "lib" / "libcufile.so.0"
    bogus.parent.mkdir(parents=True)
    bogus.write_bytes(b"not an ELF file")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CuFileUnavailable) as info:
        _cufile.load()
    msg = str(info.value)
    assert "libcufile.so.0: cannot open shared object file" in msg
    assert "libcufile.so:" in msg
    assert str(bogus) in msg
    assert "nvidia-cufile" in msg and "AIOSWAP_CUFILE_LIB" in msg
    assert _cufile.library_path() is None
    assert not _cufile.available()[0]
    # a failed load leaves no environment change and no files behind
    assert "CUFILE_LOGFILE_PATH" not in os.environ
    assert sorted(os.listdir(tmp_path)) == ["site"]


def test_load_without_wheel_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if _real_cufile_found():
        pytest.skip("a real libcufile is installed here")
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    with pytest.raises(CuFileUnavailable, match=r"no nvidia/\*/lib/libcufile\.so\* in any"):
        _cufile.load()


def test_env_var_is_the_only_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOSWAP_CUFILE_LIB", "/nonexistent/libcufile.so.0")
    with pytest.raises(CuFileUnavailable) as info:
        _cufile.load()
    msg = str(info.value)
    assert "AIOSWAP_CUFILE_LIB=/nonexistent/libcufile.so.0" in msg
    assert "No such file or directory" in msg
    assert "libcufile.so:" not in msg           # nothing else was tried
    ok, reason = _cufile.available()
    assert not ok and "/nonexistent/libcufile.so.0" in reason
    with pytest.raises(CuFileUnavailable, match="/nonexistent/libcufile.so.0"):
        _cufile.version()
    with pytest.raises(CuFileUnavailable):
        _cufile.driver_open()
    assert _cufile.driver_users() == 0


def test_env_var_expands_user(monkeypatch: pytest.MonkeyPatch, fake_libs: dict[str, Path],
                              tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "lib").mkdir(parents=True)
    shutil.copy(fake_libs["full"], home / "lib" / "libcufile.so.0")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("AIOSWAP_CUFILE_LIB", "~/lib/libcufile.so.0")
    assert _cufile.load() == str(home / "lib" / "libcufile.so.0")


def test_library_without_cufile_symbols(fake_libs: dict[str, Path]) -> None:
    with pytest.raises(CuFileUnavailable) as info:
        _cufile.load(fake_libs["empty"])
    msg = str(info.value)
    assert str(fake_libs["empty"]) in msg
    for sym in ("cuFileDriverOpen", "cuFileDriverClose_v2 or cuFileDriverClose",
                "cuFileHandleRegister", "cuFileBufRegister", "cuFileRead", "cuFileWrite"):
        assert sym in msg
    assert _cufile.library_path() is None


def test_wheel_layout_is_found(fake_libs: dict[str, Path], tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    lib = tmp_path / "site" / "nvidia" / "cufile" / "lib" / "libcufile.so.0"
    lib.parent.mkdir(parents=True)
    shutil.copy(fake_libs["full"], lib)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    where = _cufile.load()
    if where != str(lib):
        pytest.skip(f"a real libcufile is found first here ({where})")
    assert _cufile.library_path() == str(lib)
    assert _cufile.available() == (True, str(lib))


def test_load_once_and_thread_safe(fake_libs: dict[str, Path]) -> None:
    path = str(fake_libs["full"])
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(_cufile.load(path)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [path] * 8
    assert _cufile.load() == path               # later calls return the loaded library
    with pytest.raises(RuntimeError, match="already loaded"):
        _cufile.load(fake_libs["v1"])


def test_version(fake: Fake, fake_libs: dict[str, Path]) -> None:
    assert _cufile.version() == 1140
    _cufile._unload()
    _use(fake_libs["noversion"])
    assert _cufile.version() is None


def test_cufile_log_goes_to_private_dir(fake: Fake, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch,
                                        fake_libs: dict[str, Path]) -> None:
    monkeypatch.chdir(tmp_path)
    with Driver():
        logfile = fake.text("logfile_path")
    assert os.path.isabs(logfile)
    assert os.path.basename(os.path.dirname(logfile)).startswith("aioswap-cufile-")
    assert not logfile.startswith(str(tmp_path))
    assert stat.S_IMODE(os.stat(os.path.dirname(logfile)).st_mode) == 0o700
    _cufile._unload()
    assert "CUFILE_LOGFILE_PATH" not in os.environ
    assert not os.path.exists(os.path.dirname(logfile))     # empty: removed
    # the user's own setting is left alone
    monkeypatch.setenv("CUFILE_LOGFILE_PATH", "/var/tmp/mine.log")
    _use(fake_libs["full"])
    with Driver():
        assert fake.text("logfile_path") == "/var/tmp/mine.log"
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# Policy (aioswap._cufile_load, pure Python)


def test_policy_search_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert policy.search("~/lib/libcufile.so.0") == policy.Search(
        (str(tmp_path / "lib" / "libcufile.so.0"),), "explicit")
    assert policy.search("libcufile.so.0").candidates == ("libcufile.so.0",)   # the loader's
    monkeypatch.setenv(policy.LIB_ENV, "~/x.so")
    assert policy.search() == policy.Search((str(tmp_path / "x.so"),), "env")
    monkeypatch.delenv(policy.LIB_ENV)
    wheel = tmp_path / "site" / "nvidia" / "cu13" / "lib" / "libcufile.so.0"
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"")
    toolkit = tmp_path / "cuda" / "lib64" / "libcufile.so.0"
    toolkit.parent.mkdir(parents=True)
    toolkit.write_bytes(b"")
    monkeypatch.setattr(sys, "path", ["", str(tmp_path / "site")])
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    for var in ("CUDA_PATH", "CONDA_PREFIX"):
        monkeypatch.delenv(var, raising=False)
    found = policy.search()
    assert found.origin == "search"
    assert found.candidates[:3] == policy.SONAMES + (str(wheel),)
    assert found.candidates[3] == str(toolkit)
    assert policy.conflicts(None, "/a/libcufile.so.0") is None
    assert policy.conflicts("libcufile.so.0", "/a/libcufile.so.0") is None     # a bare name
    assert "already loaded from /a/libcufile.so.0" in str(
        policy.conflicts("/b/libcufile.so.0", "/a/libcufile.so.0"))


def test_policy_messages() -> None:
    msg = policy.unavailable_message(["a: nope", "b: nope"], "search")
    assert "Tried: a: nope; b: nope; no nvidia/*/lib/libcufile.so* in any sys.path" in msg
    assert "pip install nvidia-cufile-cu12" in msg
    assert policy.unavailable_message(["x"], "explicit").endswith("cannot load libcufile: x")
    assert "driver does not open (why)" in policy.driver_unavailable_message("why")


def test_policy_environment_restores_and_cleans_up(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    env = policy.CuFileEnvironment()
    monkeypatch.setenv(policy.CONFIG_ENV, "users.json")
    cfg = {"logging": {"level": "ERROR"}}
    env.apply_config(cfg)
    written = os.environ[policy.CONFIG_ENV]
    assert json.loads(Path(written).read_text()) == cfg
    assert stat.S_IMODE(os.stat(written).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(written)).st_mode) == 0o700
    env.check_config(dict(cfg))                 # the same config joins
    with pytest.raises(ValueError, match="another config"):
        env.check_config({"logging": {"level": "DEBUG"}})
    env.forget_config()
    assert os.environ[policy.CONFIG_ENV] == "users.json" and not os.path.exists(written)
    monkeypatch.delenv(policy.CONFIG_ENV)
    assert env.point_log()
    log = os.environ[policy.LOG_ENV]
    assert os.path.dirname(log) == os.path.dirname(written)
    env.unpoint_log()
    assert policy.LOG_ENV not in os.environ and not os.path.exists(os.path.dirname(log))
    monkeypatch.setenv(policy.LOG_ENV, str(tmp_path / "mine.log"))
    assert not env.point_log()                  # the user's choice stands
    with pytest.raises(FileNotFoundError):
        env.apply_config(tmp_path / "missing.json")


# ---------------------------------------------------------------------------------------------
# Error mapping


def test_error_table_is_complete() -> None:
    names = set()
    for code in range(5001, 5051):
        name, msg = _cufile.error_name(code), _cufile.error_message(code)
        if code in (5021, 5032):                # unused in cufile.h
            assert name == "CU_FILE_UNKNOWN_ERROR"
            assert msg == f"unknown cuFile error {code}"
            continue
        assert name.startswith("CU_FILE_") and name != "CU_FILE_UNKNOWN_ERROR"
        assert msg and "unknown" not in msg
        names.add(name)
    assert len(names) == 48


@pytest.mark.parametrize(("code", "name", "message"), [
    (0, "CU_FILE_SUCCESS", "cufile success"),
    (5001, "CU_FILE_DRIVER_NOT_INITIALIZED", "nvidia-fs driver is not loaded"),
    (5007, "CU_FILE_PLATFORM_NOT_SUPPORTED",
     "GPUDirect Storage not supported on current platform"),
    (5011, "CU_FILE_CUDA_DRIVER_ERROR", "CUDA Driver API error"),
    (5020, "CU_FILE_DIO_NOT_SET", "fd direct IO not set"),
    (5022, "CU_FILE_INVALID_VALUE", "invalid arguments"),
    (-5024, "CU_FILE_MEMORY_NOT_REGISTERED", "device pointer lookup failure"),
    (5029, "CU_FILE_DEVICE_NOT_FOUND", "GPU device not found"),
    (5050, "CU_FILE_IO_MAX_ERROR", "GPUDirect Storage max error"),
    (6000, "CU_FILE_UNKNOWN_ERROR", "unknown cuFile error 6000"),
])
def test_error_names_and_messages(code: int, name: str, message: str) -> None:
    assert _cufile.error_name(code) == name
    assert _cufile.error_message(code) == message


def test_map_io_result_errno() -> None:
    assert _cufile._map_io_result(4096, 0) is None
    assert _cufile._map_io_result(0, 0) is None
    exc = _cufile._map_io_result(-1, errno.ENOSPC, "cuFileWrite", 8192, 4096, 4096, "/x/f")
    assert isinstance(exc, CuFileError) and isinstance(exc, OSError)
    assert exc.errno == errno.ENOSPC
    assert exc.filename == "/x/f"
    assert exc.offset == 8192
    assert exc.strerror == ("cuFileWrite of 8192 bytes at file offset 4096: "
                            f"{os.strerror(errno.ENOSPC)} (4096 bytes done)")
    exc = _cufile._map_io_result(-1, 0)         # errno not set: still an error
    assert exc is not None and exc.errno == errno.EIO and "without setting errno" in str(exc)


def test_map_io_result_cufile_codes() -> None:
    exc = _cufile._map_io_result(-5011, 0, "cuFileRead", 100, 0, 0)
    assert exc is not None and exc.errno == 5011
    assert "CU_FILE_CUDA_DRIVER_ERROR: CUDA Driver API error" in str(exc)
    exc = _cufile._map_io_result(-5999, 0)
    assert exc is not None and exc.errno == 5999
    assert "CU_FILE_UNKNOWN_ERROR: unknown cuFile error 5999" in str(exc)
    exc = _cufile._map_io_result(-errno.EIO, 0)  # a negated errno that is not -1
    assert exc is not None and exc.errno == errno.EIO


def test_status_error() -> None:
    exc = _cufile._status_error(5009, 0, "cuFileBufRegister(0x1000, 4096)")
    assert isinstance(exc, CuFileError) and exc.errno == 5009
    assert str(exc) == ("[Errno 5009] cuFileBufRegister(0x1000, 4096) failed: "
                        "CU_FILE_DEVICE_NOT_SUPPORTED: GPUDirect Storage not supported on "
                        "current GPU")
    exc = _cufile._status_error(5011, 100, "cuFileDriverOpen")
    assert exc.cu_err == 100 and "CUresult 100 CUDA_ERROR_NO_DEVICE" in str(exc)


# ---------------------------------------------------------------------------------------------
# Driver (fake libcufile)


def test_driver_reference_counting(fake: Fake) -> None:
    _cufile.driver_open()
    _cufile.driver_open()
    assert fake["open_calls"] == 1 and _cufile.driver_users() == 2
    _cufile.driver_close()
    assert fake["close_calls"] == 0 and fake["driver_is_open"] == 1
    _cufile.driver_close()
    assert fake["close_calls"] == 1 and fake["close_v1_calls"] == 0
    assert fake["driver_is_open"] == 0 and _cufile.driver_users() == 0
    with pytest.raises(RuntimeError, match="without a matching driver_open"):
        _cufile.driver_close()
    with Driver() as d:
        assert fake["open_calls"] == 2 and not d.closed
        with Driver():
            assert fake["open_calls"] == 2
    assert d.closed and fake["close_calls"] == 2
    d.close()                                   # idempotent
    assert fake["close_calls"] == 2
    with pytest.raises(HandleClosedError):
        d.__enter__()


def test_driver_close_falls_back_to_v1(fake_libs: dict[str, Path]) -> None:
    fake = _use(fake_libs["v1"])
    with Driver():
        pass
    assert fake["close_v1_calls"] == 1 and fake["driver_is_open"] == 0


def test_driver_open_failure_is_unavailable(fake: Fake) -> None:
    fake["open_error"] = 5007
    with pytest.raises(CuFileUnavailable, match="CU_FILE_PLATFORM_NOT_SUPPORTED") as info:
        _cufile.driver_open()
    cause = info.value.__cause__
    assert isinstance(cause, CuFileError) and cause.errno == 5007
    assert _cufile.driver_users() == 0
    fake["open_error"], fake["open_cu_err"] = 5011, 100
    ok, reason = _cufile.available(check_driver=True)
    assert not ok and "CU_FILE_CUDA_DRIVER_ERROR" in reason and "CUDA_ERROR_NO_DEVICE" in reason
    assert _cufile.available() == (True, fake.path)
    fake["open_error"] = 0
    assert _cufile.available(check_driver=True) == (True, fake.path)
    assert fake["driver_is_open"] == 0 and _cufile.driver_users() == 0


def test_driver_close_error_is_raised(fake: Fake, tmp_path: Path) -> None:
    _cufile.driver_open()
    fake["driver_is_open"] = 0                  # the library lost track: close fails
    with pytest.raises(CuFileError, match="cuFileDriverClose failed: "
                                          "CU_FILE_DRIVER_NOT_INITIALIZED") as info:
        _cufile.driver_close()
    assert info.value.errno == 5001
    assert _cufile.driver_users() == 0          # counted as closed all the same


def test_driver_config_mapping(fake: Fake, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", "/etc/users-own-cufile.json")
    cfg = {"logging": {"level": "ERROR"}, "properties": {"allow_compat_mode": True}}
    with Driver(config=cfg):
        seen = fake.text("config_path")
        assert os.path.isabs(seen) and seen.endswith(".json")
        assert os.path.basename(seen).startswith("aioswap-cufile-")
        assert not seen.startswith(str(tmp_path))
        assert json.loads(fake.text("config_text")) == cfg
        assert os.environ["CUFILE_ENV_PATH_JSON"] == seen
        with Driver(config=dict(cfg)):          # the same config: fine
            pass
        with pytest.raises(ValueError, match="another config"):
            _cufile.driver_open({"logging": {"level": "DEBUG"}})
        with Driver():                          # no config: joins the open driver
            pass
    assert not os.path.exists(seen)
    assert os.environ["CUFILE_ENV_PATH_JSON"] == "/etc/users-own-cufile.json"
    assert os.listdir(tmp_path) == []
    assert fake["open_calls"] == 1


def test_driver_config_path_is_expanded(fake: Fake, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "cfg.json").write_text('{"logging": {"level": "INFO"}}')
    for given in ("cfg.json", "~/cfg.json", tmp_path / "cfg.json"):
        with Driver(config=given):
            assert fake.text("config_path") == str(tmp_path / "cfg.json")
            assert json.loads(fake.text("config_text")) == {"logging": {"level": "INFO"}}
        assert "CUFILE_ENV_PATH_JSON" not in os.environ
        assert (tmp_path / "cfg.json").exists()     # the user's file is never removed
    with pytest.raises(FileNotFoundError):
        _cufile.driver_open("missing.json")
    # a relative CUFILE_ENV_PATH_JSON of the user's is expanded for the open, then restored
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", "cfg.json")
    with Driver():
        assert fake.text("config_path") == str(tmp_path / "cfg.json")
    assert os.environ["CUFILE_ENV_PATH_JSON"] == "cfg.json"


def test_unclosed_driver_warns(fake: Fake) -> None:
    d = Driver()
    with pytest.warns(ResourceWarning, match="unclosed aioswap._cufile.Driver"):
        del d
        gc.collect()
    assert _cufile.driver_users() == 0 and fake["driver_is_open"] == 0


# ---------------------------------------------------------------------------------------------
# File handles (fake libcufile: "device" memory is host memory)


def test_handles_share_one_registration(fake: Fake, tmp_path: Path) -> None:
    path = _file(tmp_path / "f.bin", os.urandom(8192))
    a = CuFileHandle(path, direct=False)
    b = CuFileHandle(str(path), direct=False)
    assert fake["register_calls"] == 1 and fake["open_calls"] == 1
    assert a.fileno() == b.fileno()
    assert _cufile._state()["registrations"] == 2
    c = CuFileHandle(path, write=True, direct=False)    # other access: its own registration
    assert fake["register_calls"] == 2 and c.fileno() != a.fileno()
    shared = a.fileno()
    a.close()
    a.close()                                   # idempotent
    assert fake["deregister_calls"] == 0
    os.fstat(shared)                            # still open for b
    b.close()
    assert fake["deregister_calls"] == 1 and fake["close_calls"] == 0
    with pytest.raises(OSError):                # closed with the last handle on it
        os.fstat(shared)
    c.close()
    assert fake["deregister_calls"] == 2 and fake["handles_open"] == 0
    assert fake["close_calls"] == 1 and _cufile.driver_users() == 0
    assert a.closed and repr(a) == "<aioswap._cufile.CuFileHandle closed>"
    with pytest.raises(HandleClosedError):
        a.read(1, 1)
    with pytest.raises(HandleClosedError):
        a.fileno()


def test_handle_on_callers_fd(fake: Fake, tmp_path: Path) -> None:
    data = os.urandom(4096)
    path = _file(tmp_path / "f.bin", data)
    fd = os.open(path, os.O_RDONLY)
    try:
        with CuFileHandle(fd) as a, CuFileHandle(fd) as b:
            assert fake["register_calls"] == 1
            assert a.fileno() == fd and a.path is None
            assert a.readable and not a.writable
            out = np.zeros(4096, np.uint8)
            assert b.read(out.ctypes.data, 4096) == 4096
            assert out.tobytes() == data
            with pytest.raises(io.UnsupportedOperation, match="not open for writing"):
                a.write(out.ctypes.data, 16)
        os.fstat(fd)                            # still the caller's
        assert fake["deregister_calls"] == 1
        with pytest.raises(ValueError, match="create/truncate"):
            CuFileHandle(fd, create=True)
    finally:
        os.close(fd)


def test_registration_failure(fake: Fake, tmp_path: Path) -> None:
    path = _file(tmp_path / "f.bin", b"x" * 10)
    fake["register_error"] = 5018
    with pytest.raises(CuFileError, match="cuFileHandleRegister.*CU_FILE_INVALID_FILE_TYPE"):
        CuFileHandle(path, direct=False)
    assert _cufile.driver_users() == 0 and fake["driver_is_open"] == 0
    with pytest.raises(FileNotFoundError):
        CuFileHandle(tmp_path / "missing", direct=False)
    assert _cufile.driver_users() == 0


def test_direct_open(fake: Fake, tmp_dir: Path) -> None:
    path = tmp_dir / "direct.bin"
    try:
        h = CuFileHandle(path, write=True, create=True, truncate=True)
    except DirectIOUnsupportedError:
        assert not path.exists()                # a file it created is removed again
        pytest.skip(f"{tmp_dir} refuses O_DIRECT")
    with h:
        assert fcntl_flags(h.fileno()) & os.O_DIRECT
        buf = _aligned(8192)
        buf[:] = _data(8192)
        assert h.write(buf.ctypes.data, 8192) == 8192
        back = _aligned(8192)
        assert h.read(back.ctypes.data, 8192) == 8192
        assert np.array_equal(buf, back)


def fcntl_flags(fd: int) -> int:
    import fcntl
    return fcntl.fcntl(fd, fcntl.F_GETFL)


def _aligned(n: int, align: int = 4096) -> np.ndarray:
    raw = np.zeros(n + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + n]


@pytest.mark.parametrize("max_io", [0, 1, 7, 4096, 10000])
def test_roundtrip_continues_short_counts(fake: Fake, tmp_path: Path, max_io: int) -> None:
    n = 12345
    src = _data(n)
    fake["max_io"] = max_io
    with CuFileHandle(tmp_path / "f.bin", write=True, create=True, direct=False) as h:
        assert h.write(src.ctypes.data, n, 100) == n
        calls = fake["write_calls"]
        assert calls == (1 if max_io == 0 else -(-n // max_io))
        dst = np.zeros(n, np.uint8)
        assert h.read(dst.ctypes.data, n, 100) == n
        assert fake["read_calls"] == calls
    assert np.array_equal(src, dst)
    raw = (tmp_path / "f.bin").read_bytes()
    assert raw[:100] == b"\0" * 100 and raw[100:] == src.tobytes()


def test_offsets_and_zero_bytes(fake: Fake, tmp_path: Path) -> None:
    data = os.urandom(1000)
    path = _file(tmp_path / "f.bin", data)
    dst = np.zeros(600, np.uint8)
    with CuFileHandle(path, direct=False) as h:
        assert h.read(dst.ctypes.data, 300, file_offset=500, buf_offset=200) == 300
        assert fake["last_base"] == dst.ctypes.data and fake["last_buf_offset"] == 200
        assert fake["last_file_offset"] == 500
        assert dst[200:500].tobytes() == data[500:800]
        assert not dst[:200].any() and not dst[500:].any()
        calls = fake["read_calls"]
        assert h.read(dst.ctypes.data, 0) == 0 and fake["read_calls"] == calls
        for bad in ({"nbytes": -1}, {"file_offset": -1}, {"buf_offset": -1}):
            kw: dict[str, int] = {"nbytes": 1, **bad}
            with pytest.raises(ValueError, match="negative"):
                h.read(dst.ctypes.data, **kw)
        with pytest.raises(ValueError, match="invalid buffer address"):
            h.read(0, 16)
        with pytest.raises(TypeError):
            h.read(1.5, 16)
        with pytest.raises(io.UnsupportedOperation):
            h.write(dst.ctypes.data, 16)


def test_read_past_eof(fake: Fake, tmp_path: Path) -> None:
    path = _file(tmp_path / "f.bin", os.urandom(60))
    dst = np.zeros(100, np.uint8)
    fake["max_io"] = 16
    with CuFileHandle(path, direct=False) as h:
        with pytest.raises(ShortReadError) as info:
            h.read(dst.ctypes.data, 100, 10)
    err = info.value
    assert isinstance(err, EOFError)
    assert (err.path, err.offset, err.nbytes, err.file_size) == (str(path), 10, 100, 60)
    assert "reached end of file at offset 60 (50 bytes read)" in str(err)


def test_errno_errors(fake: Fake, tmp_path: Path) -> None:
    path = _file(tmp_path / "f.bin", os.urandom(4096))
    dst = np.zeros(4096, np.uint8)
    fake["max_io"], fake["fail_after"], fake["fail_errno"] = 1000, 2, errno.EIO
    with CuFileHandle(path, direct=False) as h:
        with pytest.raises(CuFileError) as info:
            h.read(dst.ctypes.data, 4096, 0)
    err = info.value
    assert err.errno == errno.EIO and err.filename == str(path) and err.offset == 2000
    assert err.strerror == ("cuFileRead of 4096 bytes at file offset 0: "
                            f"{os.strerror(errno.EIO)} (2000 bytes done)")


def test_real_errno_from_the_file(fake: Fake, tmp_path: Path) -> None:
    path = _file(tmp_path / "f.bin", b"")
    fd = os.open(path, os.O_WRONLY)             # writable to aioswap, not readable
    try:
        with CuFileHandle(fd) as h:
            src = _data(64)
            assert h.write(src.ctypes.data, 64) == 64
            with pytest.raises(io.UnsupportedOperation, match="not open for reading"):
                h.read(src.ctypes.data, 64)
    finally:
        os.close(fd)
    # the kernel's errno comes through cuFile's -1: pread on a directory is EISDIR
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        with CuFileHandle(fd) as h:
            with pytest.raises(CuFileError) as info:
                h.read(src.ctypes.data, 64)
    finally:
        os.close(fd)
    assert info.value.errno == errno.EISDIR
    assert os.strerror(errno.EISDIR) in str(info.value)


def test_cufile_code_errors(fake: Fake, tmp_path: Path) -> None:
    src = _data(4096)
    fake["fail_code"] = 5024
    with CuFileHandle(tmp_path / "f.bin", write=True, create=True, direct=False) as h:
        with pytest.raises(CuFileError) as info:
            h.write(src.ctypes.data, 4096, 8192)
        err = info.value
        assert err.errno == 5024 and err.offset == 8192
        assert ("cuFileWrite of 4096 bytes at file offset 8192: CU_FILE_MEMORY_NOT_REGISTERED: "
                "device pointer lookup failure (0 bytes done)") in str(err)
        fake["fail_code"] = 5999
        with pytest.raises(CuFileError, match="unknown cuFile error 5999"):
            h.read(src.ctypes.data, 16)


def test_eintr_is_retried(fake: Fake, tmp_path: Path) -> None:
    data = os.urandom(5000)
    path = _file(tmp_path / "f.bin", data)
    dst = np.zeros(5000, np.uint8)
    fake["max_io"], fake["fail_after"], fake["fail_times"] = 1000, 1, 3
    fake["fail_errno"] = errno.EINTR
    with CuFileHandle(path, direct=False) as h:
        assert h.read(dst.ctypes.data, 5000) == 5000
    assert dst.tobytes() == data
    assert fake["read_calls"] == 5 + 3


def test_write_without_progress_and_overrun(fake: Fake, tmp_path: Path) -> None:
    src = _data(100)
    with CuFileHandle(tmp_path / "f.bin", write=True, create=True, direct=False) as h:
        fake["zero_write"] = 1
        with pytest.raises(CuFileError, match="no progress at offset 0") as info:
            h.write(src.ctypes.data, 100)
        assert info.value.errno == errno.EIO
        fake["zero_write"], fake["overrun"] = 0, 1
        with pytest.raises(CuFileError, match="reported 101 bytes for a call of 100"):
            h.write(src.ctypes.data, 100)


def test_concurrent_reads_on_one_handle(fake: Fake, tmp_path: Path) -> None:
    data = os.urandom(1 << 16)
    path = _file(tmp_path / "f.bin", data)
    fake["max_io"] = 512
    errors: list[BaseException] = []
    with CuFileHandle(path, direct=False) as h:

        def work(k: int) -> None:
            try:
                dst = np.zeros(1 << 14, np.uint8)
                for _ in range(20):
                    h.read(dst.ctypes.data, 1 << 14, k << 14)
                    assert dst.tobytes() == data[k << 14:(k + 1) << 14]
            except BaseException as exc:   # reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []


def test_unclosed_handle_warns_and_deregisters(fake: Fake, tmp_path: Path) -> None:
    path = _file(tmp_path / "f.bin", b"x")
    h = CuFileHandle(path, direct=False)
    with pytest.warns(ResourceWarning, match="unclosed aioswap._cufile.CuFileHandle"):
        del h
        gc.collect()
    assert fake["deregister_calls"] == 1 and _cufile.driver_users() == 0


# ---------------------------------------------------------------------------------------------
# Buffer registration (fake libcufile)


def test_buf_register_is_only_the_c_call(fake: Fake, tmp_path: Path) -> None:
    data = os.urandom(8192)
    path = _file(tmp_path / "f.bin", data)
    mem = np.zeros(16384, np.uint8)
    base = mem.ctypes.data
    _cufile.buf_register(base, 16384)
    try:
        assert fake["buf_register_calls"] == 1 and _cufile.driver_users() == 1
        assert _cufile._state()["buffers"] == 1
        with CuFileHandle(path, direct=False) as h:
            # (base, offset) reach cuFile as given: the caller translates interior addresses
            assert h.read(base, 4096, 100, buf_offset=1024) == 4096
            assert fake["last_base"] == base and fake["last_buf_offset"] == 1024
            assert mem[1024:1024 + 4096].tobytes() == data[100:4196]
        # nothing is recorded here: cuFile itself refuses a base registered twice
        with pytest.raises(CuFileError, match="CU_FILE_MEMORY_ALREADY_REGISTERED"):
            _cufile.buf_register(base, 100)
        assert _cufile.driver_users() == 1 and _cufile._state()["buffers"] == 1
        with pytest.raises(CuFileError, match="CU_FILE_MEMORY_NOT_REGISTERED"):
            _cufile.buf_deregister(base + 4096)
        assert _cufile.driver_users() == 1 and _cufile._state()["buffers"] == 1
    finally:
        _cufile.buf_deregister(base)
    assert fake["bufs_open"] == 0 and _cufile._state()["buffers"] == 0
    assert _cufile.driver_users() == 0 and fake["driver_is_open"] == 0
    calls = fake["buf_deregister_calls"]
    with pytest.raises(ValueError, match="no device memory is registered"):
        _cufile.buf_deregister(base)            # refused before any C call
    assert fake["buf_deregister_calls"] == calls
    assert not hasattr(_cufile, "registered_range")
    assert not hasattr(_cufile, "DeviceRangeRegistry")


def test_gds_transport_uses_the_registry_device_index(fake: Fake, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The one record of registered device ranges is aioswap.pinned's device index."""
    from aioswap.gds import _CuFileTransport
    monkeypatch.setenv("AIOSWAP_BUFFERED", "1")     # the fake's pread takes any offset
    data = os.urandom(8192)
    path = _file(tmp_path / "f.bin", data)
    mem = np.zeros(16384, np.uint8)                 # the fake serves host memory
    base = mem.ctypes.data
    other = np.zeros(64, np.uint8)
    with aioswap.AioHandle() as h, h.open(path, "r") as f:
        with pinned.register(base, 16384, device=True, owner=mem):
            assert pinned.registry.find(base + 1000, 4096, device=True) == (base, base + 16384)
            assert pinned.registry.find(base + 1000, 4096) is None      # not a host range
            _cufile.buf_register(base, 16384)
            try:
                moved = _CuFileTransport().transfer(False, base + 1000, 4096, f, 100)
                assert moved == (4096, "direct")
                assert fake["last_base"] == base and fake["last_buf_offset"] == 1000
                assert mem[1000:5096].tobytes() == data[100:4196]
                moved = _CuFileTransport().transfer(False, other.ctypes.data, 64, f, 0)
                assert moved == (64, "bounce")
                assert fake["last_base"] == other.ctypes.data
                assert fake["last_buf_offset"] == 0
                assert other.tobytes() == data[:64]
            finally:
                _cufile.buf_deregister(base)
        assert pinned.registry.find(base, 1, device=True) is None
    assert fake["handles_open"] == 0


def test_gds_registration_lives_with_the_file(fake: Fake, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A file is registered with cuFile on its first device request and deregistered when
    it closes, not once per request; a file closed with requests in flight deregisters
    after the last one."""
    from aioswap.gds import _CuFileTransport
    monkeypatch.setenv("AIOSWAP_BUFFERED", "1")     # the fake's pread takes any offset
    data = os.urandom(8192)
    path = _file(tmp_path / "f.bin", data)
    out = np.zeros(4096, np.uint8)
    tr = _CuFileTransport()
    regs, deregs = fake["register_calls"], fake["deregister_calls"]
    with aioswap.AioHandle() as h:
        f = h.open(path, "r")
        for off in (0, 512, 4096):
            assert tr.transfer(False, out.ctypes.data, 4096, f, off) == (4096, "bounce")
            assert out.tobytes() == data[off:off + 4096]
        assert fake["register_calls"] == regs + 1 and fake["handles_open"] == 1
        g = h.open(path, "r")                   # another file: its own registration
        tr.transfer(False, out.ctypes.data, 64, g, 0)
        g.close()
        assert fake["deregister_calls"] == deregs + 1
        f.use()                                 # a request in flight on f
        f.close()
        assert fake["handles_open"] == 1        # still registered under the request
        with pytest.raises(ValueError, match="closed file"):
            tr.transfer(False, out.ctypes.data, 64, f, 0)
        f.unuse()
        assert fake["deregister_calls"] == deregs + 2 and fake["handles_open"] == 0
        assert fake["register_calls"] == regs + 2


def test_buf_register_flags_and_errors(fake: Fake) -> None:
    mem = np.zeros(4096, np.uint8)
    _cufile.buf_register(mem.ctypes.data, 4096, flags=0)
    assert fake["last_flags"] == 0
    _cufile.buf_deregister(mem.ctypes.data)
    fake["buf_register_error"] = 5036
    with pytest.raises(CuFileError, match="CU_FILE_GPU_MEMORY_PINNING_FAILED") as info:
        _cufile.buf_register(mem.ctypes.data, 4096)
    assert info.value.errno == 5036
    assert _cufile._state()["buffers"] == 0
    assert _cufile.driver_users() == 0
    for ptr, n in ((0, 4096), (mem.ctypes.data, 0)):
        with pytest.raises(ValueError):
            _cufile.buf_register(ptr, n)


def test_buf_deregister_failure_keeps_registration(fake: Fake) -> None:
    mem = np.zeros(4096, np.uint8)
    _cufile.buf_register(mem.ctypes.data, 4096)
    fake["buf_deregister_error"] = 5027
    with pytest.raises(CuFileError, match="cuFileBufDeregister.*CU_FILE_HANDLE_NOT_REG"):
        _cufile.buf_deregister(mem.ctypes.data)
    assert _cufile._state()["buffers"] == 1
    assert _cufile.driver_users() == 1
    fake["buf_deregister_error"] = 0
    _cufile.buf_deregister(mem.ctypes.data)
    assert _cufile.driver_users() == 0


# ---------------------------------------------------------------------------------------------
# Stub


def test_stub_matches_module() -> None:
    stub = Path(_cufile.__file__).with_name("_cufile.pyi")
    if not stub.exists():
        stub = Path(aioswap.__file__).with_name("_cufile.pyi")
    tree = ast.parse(stub.read_text())
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert set(_cufile.__all__) <= names
    for name in names:
        assert hasattr(_cufile, name), name


# ---------------------------------------------------------------------------------------------
# Real cuFile on a GPU


@pytest.fixture
def gpu_cufile() -> Iterator[Any]:
    """torch with a CUDA device, the real libcufile, and an open driver; else a skip."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    ok, why = _cufile.available()
    if not ok:
        pytest.skip(f"needs libcufile: {why}")
    torch.zeros(1, device="cuda")               # a CUDA context before cuFile's
    try:
        _cufile.driver_open()
    except CuFileUnavailable as exc:
        pytest.skip(f"the cuFile driver does not open here: {exc}")
    try:
        yield torch
    finally:
        _cufile.driver_close()


def _gpu_file(path: Path, **kw: Any) -> CuFileHandle:
    try:
        return CuFileHandle(path, **kw)
    except DirectIOUnsupportedError:            # tmpfs: cuFile's compatibility mode
        return CuFileHandle(path, direct=False, **kw)


@pytest.mark.gpu
@pytest.mark.cufile
def test_gpu_version_and_library(gpu_cufile: Any) -> None:
    assert os.path.isabs(_cufile.library_path() or "")
    v = _cufile.version()
    assert v is None or v > 0


@pytest.mark.gpu
@pytest.mark.cufile
@pytest.mark.parametrize("register", [True, False])
def test_gpu_roundtrip(gpu_cufile: Any, tmp_dir: Path, register: bool) -> None:
    torch = gpu_cufile
    n = 4 << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    torch.cuda.synchronize()
    path = tmp_dir / "gds.bin"
    if register:
        _cufile.buf_register(src.data_ptr(), n)
        _cufile.buf_register(dst.data_ptr(), n)
    try:
        with _gpu_file(path, write=True, create=True, truncate=True) as h:
            assert h.write(src.data_ptr(), n, 0) == n
            assert h.read(dst.data_ptr(), n, 0) == n
            assert torch.equal(src, dst)
            # an interior piece, as cuFile wants it for registered memory: (base, offset)
            dst.zero_()
            torch.cuda.synchronize()
            assert h.read(dst.data_ptr(), n - 8192, 4096, buf_offset=4096) == n - 8192
    finally:
        if register:
            _cufile.buf_deregister(src.data_ptr())
            _cufile.buf_deregister(dst.data_ptr())
    assert torch.equal(dst[4096:n - 4096], src[4096:n - 4096])
    assert not dst[:4096].any() and not dst[n - 4096:].any()
    assert path.read_bytes() == src.cpu().numpy().tobytes()


@pytest.mark.gpu
@pytest.mark.cufile
def test_gpu_read_past_eof(gpu_cufile: Any, tmp_dir: Path) -> None:
    torch = gpu_cufile
    path = _file(tmp_dir / "short.bin", os.urandom(8192))
    dst = torch.zeros(16384, dtype=torch.uint8, device="cuda")
    with _gpu_file(path) as h, pytest.raises(ShortReadError) as info:
        h.read(dst.data_ptr(), 16384, 0)
    assert info.value.file_size == 8192
