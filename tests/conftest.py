"""Shared fixtures: kept small on purpose; each test module builds what else it needs."""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import IO

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # As a normal user (RLIMIT_MEMLOCK of a few MiB, no CAP_IPC_LOCK) a handle's 64 MiB bounce
    # ring cannot be locked, and the library says so once per process with a
    # PinnedMemoryWarning, which "error" would turn into a failure of whichever test met it
    # first. That fallback is the documented behaviour there; tests that check the warning
    # catch it themselves (pytest.warns). Where locking is not limited every lock succeeds
    # and the warning stays an error.
    if _memlock_room() is not None:
        config.addinivalue_line("filterwarnings",
                                "ignore::aioswap.errors.PinnedMemoryWarning")


# The default run is spread over worker processes (pytest-xdist: ``-n`` in pyproject's
# addopts). A test marked ``alone`` reads or takes state the whole machine shares (fs.aio-nr,
# every AIO context of the system) or times itself, so it runs while no other test of the
# run does: every test holds a shared lock on a file of the run, an ``alone`` test an
# exclusive one. The gate lock in front keeps the workers' back-to-back tests from starving
# a waiting ``alone`` test.
_LOCKS: dict[str, IO[bytes]] = {}


def _run_lock(config: pytest.Config, name: str) -> IO[bytes] | None:
    """One lock file shared by the workers of this run; None when the run has no workers."""
    if not hasattr(config, "workerinput"):
        return None
    if name not in _LOCKS:
        # each worker's base temp is <run's base temp>/gwN: the parent is the run's
        base = config._tmp_path_factory.getbasetemp().parent  # type: ignore[attr-defined]
        _LOCKS[name] = open(base / f"aioswap-{name}.lock", "ab")
    return _LOCKS[name]


def pytest_unconfigure(config: pytest.Config) -> None:
    while _LOCKS:
        _LOCKS.popitem()[1].close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None
                            ) -> Generator[None, None, None]:
    run, gate = _run_lock(item.config, "run"), _run_lock(item.config, "gate")
    if run is None or gate is None:
        yield
        return
    alone = item.get_closest_marker("alone") is not None
    fcntl.flock(gate, fcntl.LOCK_EX)
    try:
        fcntl.flock(run, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    finally:
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
    try:
        yield                                   # setup, call and teardown of the test
    finally:
        fcntl.flock(run, fcntl.LOCK_UN)
        if alone:
            fcntl.flock(gate, fcntl.LOCK_UN)


# Tests that need O_DIRECT must run on a real disk. pytest's tmp_path is fine where /tmp is
# a disk file system; set AIOSWAP_TEST_DIR to point the tests at a given drive (e.g. NVMe).
_ENV_DIR = "AIOSWAP_TEST_DIR"


@pytest.fixture(scope="session")
def disk_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Session-wide directory on a real disk (``$AIOSWAP_TEST_DIR`` or pytest's base temp)."""
    base = os.environ.get(_ENV_DIR)
    if not base:
        yield tmp_path_factory.getbasetemp()
        return
    d = Path(tempfile.mkdtemp(prefix="aioswap-test-", dir=base))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tmp_dir(disk_root: Path, tmp_path: Path) -> Path:
    """A fresh, empty directory on a real disk, removed with the session."""
    if not os.environ.get(_ENV_DIR):
        return tmp_path
    return Path(tempfile.mkdtemp(dir=disk_root))


#: The engine's backends; suites that touch the engine run on each one that works here.
ENGINE_BACKENDS = ("io_uring", "aio", "threads")


@pytest.fixture(params=ENGINE_BACKENDS)
def engine_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """One engine backend (handles and subprocesses get it through ``AIOSWAP_BACKEND``);
    skipped, with the kernel's reason, where it cannot be set up."""
    from aioswap import _aio

    ok, why = _aio.aio_available(request.param)
    if not ok:
        pytest.skip(f"backend {request.param} does not work here: {why}")
    monkeypatch.setenv("AIOSWAP_BACKEND", request.param)
    return str(request.param)


def _memlock_room() -> int | None:
    """Bytes this process may lock in all: None where there is no limit (CAP_IPC_LOCK, as
    root, or an unlimited RLIMIT_MEMLOCK), else the soft limit (8 MiB for a normal user on
    most distributions)."""
    import resource
    with open("/proc/self/status") as f:
        caps = next((int(x.split()[1], 16) for x in f if x.startswith("CapEff:")), 0)
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if caps & (1 << 14) or soft == resource.RLIM_INFINITY:      # 14: CAP_IPC_LOCK
        return None
    return int(soft)


@pytest.fixture(scope="session")
def memlock_room() -> int | None:
    """What this run may lock (see :func:`_memlock_room`): tests whose subject is not the
    limit size their locked buffers to fit under a normal user's few MiB, and keep their
    full sizes where locking is not limited."""
    return _memlock_room()
