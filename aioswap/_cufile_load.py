"""The policy behind :mod:`aioswap._cufile`: where libcufile is looked for, and what cuFile reads.

:mod:`aioswap._cufile` keeps only the C calls (``dlopen``/``dlsym`` and the cuFile entry
points) and its reference counts; what it decides in Python lives here, typed:

- the candidates to ``dlopen``, in order (:func:`search`), and the message naming every place
  tried when none loads (:func:`unavailable_message`);
- the environment cuFile reads (:class:`CuFileEnvironment`): ``CUFILE_LOGFILE_PATH``, pointed
  at a private 0700 temporary directory unless the user set it (cuFile writes ``cufile.log``
  into the current directory otherwise), and ``CUFILE_ENV_PATH_JSON`` for a driver config,
  a mapping written to a private file or a path made absolute. Every variable set is put
  back as it was.

Nothing here is thread-safe by itself: the binding calls it with its own lock held.
"""
from __future__ import annotations

import atexit
import glob
import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

__all__ = [
    "CONFIG_ENV",
    "LIB_ENV",
    "LOG_ENV",
    "SONAMES",
    "Config",
    "CuFileEnvironment",
    "Search",
    "config_key",
    "conflicts",
    "driver_unavailable_message",
    "environment",
    "expand_lib",
    "search",
    "system_candidates",
    "unavailable_message",
    "wheel_candidates",
]

LIB_ENV = "AIOSWAP_CUFILE_LIB"
"""Names the one library to load, when set."""
SONAMES = ("libcufile.so.0", "libcufile.so")
"""Names tried through the dynamic loader's own search first."""
LOG_ENV = "CUFILE_LOGFILE_PATH"
CONFIG_ENV = "CUFILE_ENV_PATH_JSON"

Config = Union[Mapping[str, Any], str, "os.PathLike[str]"]
"""A cuFile configuration: a mapping in ``cufile.json``'s schema, or the path of such a file."""
_PathArg = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]


def expand_lib(value: str) -> str:
    """A path is made absolute (``~`` expanded); a bare name is left to the loader's search."""
    value = os.path.expanduser(value)
    return os.path.abspath(value) if "/" in value else value


def wheel_candidates() -> list[str]:
    """libcufile from NVIDIA wheels (nvidia/cufile/lib, nvidia/cu13/lib...) on sys.path."""
    found: list[str] = []
    seen: set[str] = set()
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


def system_candidates() -> list[str]:
    """libcufile.so.0 in the CUDA toolkit and conda locations that exist."""
    dirs: list[str] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value:
            dirs.append(os.path.join(value, "lib64"))
    prefix = os.environ.get("CONDA_PREFIX")
    if prefix:
        dirs.append(os.path.join(prefix, "lib"))
    dirs.append("/usr/local/cuda/lib64")
    out: list[str] = []
    for d in dirs:
        p = os.path.join(os.path.abspath(os.path.expanduser(d)), "libcufile.so.0")
        if os.path.exists(p) and p not in out:
            out.append(p)
    return out


@dataclass(frozen=True)
class Search:
    """What to ``dlopen``, in order, and where the list came from.

    ``origin`` is ``"explicit"`` (a path given to ``load()``), ``"env"`` (``$AIOSWAP_CUFILE_LIB``)
    or ``"search"`` (sonames, wheels, toolkit and conda directories).
    """

    candidates: tuple[str, ...]
    origin: str


def search(path: _PathArg | None = None) -> Search:
    """The candidates for ``load(path)``: ``path`` alone, else ``$AIOSWAP_CUFILE_LIB`` alone,
    else :data:`SONAMES`, then :func:`wheel_candidates`, then :func:`system_candidates`."""
    if path is not None:
        return Search((expand_lib(os.fsdecode(path)),), "explicit")
    value = os.environ.get(LIB_ENV)
    if value:
        return Search((expand_lib(value),), "env")
    return Search(SONAMES + tuple(wheel_candidates()) + tuple(system_candidates()), "search")


def conflicts(path: _PathArg | None, loaded: str) -> str | None:
    """Why ``load(path)`` cannot be served by the library loaded from ``loaded``, or None."""
    if path is None:
        return None
    want = expand_lib(os.fsdecode(path))
    if "/" in want and os.path.realpath(want) != os.path.realpath(loaded):
        return f"cuFile is already loaded from {loaded}; cannot load {want} as well"
    return None


def unavailable_message(failures: Sequence[str], origin: str) -> str:
    """The message of :class:`~aioswap.errors.CuFileUnavailable` after every candidate failed."""
    tried = "; ".join(failures)
    if origin == "explicit":
        return f"cuFile (GPUDirect Storage) is unavailable: cannot load libcufile: {tried}"
    if origin == "env":
        return (f"cuFile (GPUDirect Storage) is unavailable: {LIB_ENV}="
                f"{os.environ.get(LIB_ENV)} cannot be loaded: {tried}. Point {LIB_ENV} at "
                f"libcufile.so.0, or unset it to search the usual places")
    if not any("nvidia" in f for f in failures):
        tried += "; no nvidia/*/lib/libcufile.so* in any sys.path entry"
    return (f"cuFile (GPUDirect Storage) is unavailable: libcufile was not found. Tried: "
            f"{tried}. Install NVIDIA's cuFile wheel (pip install nvidia-cufile-cu12; CUDA "
            f"builds of torch depend on it) or set {LIB_ENV} to the library's path")


def driver_unavailable_message(reason: str) -> str:
    """The message of :class:`~aioswap.errors.CuFileUnavailable` when the driver does not open."""
    return (f"cuFile (GPUDirect Storage) is unavailable: the cuFile driver does not open "
            f"({reason}); a GPU, its driver and a supported platform are needed")


def config_key(config: Config) -> tuple[str, str]:
    """What makes two configs the same: the JSON text of a mapping, or a file's real path."""
    if isinstance(config, Mapping):
        return ("json", json.dumps(config, sort_keys=True, default=str))
    return ("path", os.path.abspath(os.path.expanduser(os.fsdecode(config))))


class CuFileEnvironment:
    """The variables aioswap sets for cuFile, and the private files behind them.

    One instance, :data:`environment`, serves the process; its files are removed at exit.
    """

    def __init__(self) -> None:
        self._saved: dict[str, str | None] = {}   # variables set -> value before (None: unset)
        self._private: str | None = None          # private directory (config, cuFile log)
        self._config_file: str | None = None      # JSON written for the open driver
        self.config: tuple[str, str] | None = None    # config_key of the open driver

    # ------------------------------------------------------------------- variables
    def set(self, name: str, value: str) -> None:
        """Set ``name``, remembering the user's value the first time."""
        if name not in self._saved:
            self._saved[name] = os.environ.get(name)
        os.environ[name] = value

    def restore(self, name: str) -> None:
        """Put ``name`` back as the user had it (no-op when aioswap did not set it)."""
        if name in self._saved:
            old = self._saved.pop(name)
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old

    def private_dir(self) -> str:
        """The process's private temporary directory for cuFile's config and log (0700)."""
        if self._private is None or not os.path.isdir(self._private):
            self._private = os.path.abspath(tempfile.mkdtemp(prefix="aioswap-cufile-"))
        return self._private

    # ------------------------------------------------------------------- the log file
    def point_log(self) -> bool:
        """Before loading: send cuFile's log to the private directory unless the user chose
        a place (``CUFILE_LOGFILE_PATH``); True when it was set here."""
        if os.environ.get(LOG_ENV):
            return False
        self.set(LOG_ENV, os.path.join(self.private_dir(), "cufile.log"))
        return True

    def unpoint_log(self) -> None:
        """After a failed load or an unload: restore the variable and remove empty files."""
        self.restore(LOG_ENV)
        self.cleanup()

    # ------------------------------------------------------------------- driver config
    def check_config(self, config: Config | None) -> None:
        """Joining an open driver: ``config`` must be None or the one it was opened with.

        Raises
        ------
        ValueError
            Another config.
        """
        if config is not None and config_key(config) != self.config:
            raise ValueError("the cuFile driver is already open with another config; "
                             "a config applies only to the first driver_open()")

    def apply_config(self, config: Config | None) -> None:
        """Before the first ``cuFileDriverOpen``: point ``CUFILE_ENV_PATH_JSON`` at ``config``.

        A mapping is written to a file in the private directory; a path is made absolute.
        Without a config, a relative or ``~`` value of the user's is made absolute.

        Raises
        ------
        FileNotFoundError
            ``config`` names a file that does not exist.
        """
        if config is None:
            user = os.environ.get(CONFIG_ENV)
            if user and (not os.path.isabs(user) or user.startswith("~")):
                self.set(CONFIG_ENV, os.path.abspath(os.path.expanduser(user)))
            self.config = None
            return
        key = config_key(config)
        if key[0] == "json":
            assert isinstance(config, Mapping)
            path = self._write_config(config)
            self._config_file = path
        else:
            path = key[1]
            if not os.path.isfile(path):
                raise FileNotFoundError(f"cuFile config {path!r} does not exist")
        self.set(CONFIG_ENV, path)
        self.config = key

    def _write_config(self, config: Mapping[str, Any]) -> str:
        """Write a config mapping to a private file (0600); return its absolute path."""
        fd, name = tempfile.mkstemp(prefix="aioswap-cufile-", suffix=".json",
                                    dir=self.private_dir())
        name = os.path.abspath(name)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(dict(config), f, indent=1)
        except BaseException:
            os.unlink(name)
            raise
        return name

    def forget_config(self) -> None:
        """After the driver closed (or failed to open): undo :meth:`apply_config`."""
        self.restore(CONFIG_ENV)
        self._drop_config_file()
        self.config = None

    def _drop_config_file(self) -> None:
        if self._config_file is not None:
            try:
                os.unlink(self._config_file)
            except OSError:
                pass
            self._config_file = None

    def cleanup(self) -> None:
        """Remove aioswap's config file, an empty cuFile log and the directory when empty."""
        self._drop_config_file()
        if self._private is None:
            return
        logfile = os.path.join(self._private, "cufile.log")
        try:
            if os.path.getsize(logfile) == 0:
                os.unlink(logfile)
        except OSError:
            pass
        try:
            os.rmdir(self._private)
            self._private = None
        except OSError:
            pass        # cuFile logged something: keep it for the user


environment = CuFileEnvironment()
"""The process's one :class:`CuFileEnvironment`."""
atexit.register(environment.cleanup)
