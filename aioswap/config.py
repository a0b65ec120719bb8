"""The ``"aio"`` configuration section: strict parsing, exact emission, one set of defaults.

:class:`AioConfig` reads the section as DeepSpeed spells it (``block_size``, ``queue_depth``,
``intra_op_parallelism``, ``single_submit``, ``overlap_events``, ``use_gds``) and writes back
exactly those keys with JSON booleans, so what aioswap prints, aioswap and DeepSpeed's
``get_aio_config`` both read back unchanged.

Two sets of defaults, on purpose, each used in one place:

- :data:`DEFAULT_CONFIG` (queue depth 32) is what a handle, swapper or tool built without a
  config uses: 32 requests of 1 MiB in flight keep an NVMe drive busy where 8 do not.
  ``AIOSWAP_*`` environment variables override it (:func:`default_config`, :data:`ENVIRONMENT`).
- :data:`DEEPSPEED_DEFAULTS` (queue depth 8, DeepSpeed's ``AIO_QUEUE_DEPTH_DEFAULT``) fills the
  keys a section leaves out in :meth:`AioConfig.from_dict`, so a DeepSpeed config that omits
  ``queue_depth`` behaves under aioswap as it does under DeepSpeed.
"""
from __future__ import annotations

import difflib
import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aioswap._aio import MAX_DEPTH
from aioswap._units import parse_size
from aioswap._util import unique_keys
from aioswap.errors import ConfigError

__all__ = ["AIO_SECTION", "DEEPSPEED_DEFAULTS", "DEFAULT_CONFIG", "ENVIRONMENT", "MAX_BLOCK_SIZE",
           "MAX_PARALLELISM", "MAX_QUEUE_DEPTH", "AioConfig", "RuntimeSettings", "default_config",
           "runtime_settings"]

#: Name of the section in a DeepSpeed-style configuration.
AIO_SECTION = "aio"

#: Linux caps one read/write at ``MAX_RW_COUNT`` = ``INT_MAX & PAGE_MASK`` bytes; a larger
#: block would always come back short.
MAX_BLOCK_SIZE = 0x7FFFF000

#: Most requests in flight per AIO context: the engine's own bound (65535).
MAX_QUEUE_DEPTH = MAX_DEPTH

#: Each lane of ``intra_op_parallelism`` is a kernel context and a thread.
MAX_PARALLELISM = 256

_INT_KEYS = ("block_size", "queue_depth", "intra_op_parallelism")
_BOOL_KEYS = ("single_submit", "overlap_events", "use_gds")
_KEYS = ("block_size", "queue_depth", "intra_op_parallelism",
         "single_submit", "overlap_events", "use_gds")

# Spellings seen in the wild that mean one of our keys but that no loader reads under that
# name: DeepSpeed's ds_nvme_tune prints ``num_threads`` (older versions ``thread_count``),
# and fio users write ``iodepth``/``bs``. They are errors, never silently accepted, but the
# message names the right key.
_ALIASES = {
    "num_threads": "intra_op_parallelism",
    "thread_count": "intra_op_parallelism",
    "threads": "intra_op_parallelism",
    "num_workers": "intra_op_parallelism",
    "parallelism": "intra_op_parallelism",
    "intra_op_parallel": "intra_op_parallelism",
    "io_parallelism": "intra_op_parallelism",
    "iodepth": "queue_depth",
    "io_depth": "queue_depth",
    "qd": "queue_depth",
    "queue_size": "queue_depth",
    "bs": "block_size",
    "blocksize": "block_size",
    "block": "block_size",
    "gds": "use_gds",
    "overlap": "overlap_events",
    "submit": "single_submit",
}


def _suggest(key: str) -> str:
    """``" (did you mean 'x'?)"`` for an unknown key, or ``""`` when nothing is close."""
    lowered = key.lower() if isinstance(key, str) else key
    if lowered in _KEYS and lowered != key:
        return f"; did you mean {lowered!r}?"
    if lowered in _ALIASES:
        return (f"; did you mean {_ALIASES[lowered]!r}? ({key!r} is not read by aioswap's "
                f"or DeepSpeed's loader)")
    if isinstance(key, str):
        close = difflib.get_close_matches(lowered, _KEYS, n=1, cutoff=0.6)
        if close:
            return f"; did you mean {close[0]!r}?"
    return ""


def _check_int(key: str, value: Any) -> tuple[int | None, str | None]:
    """Coerce an integer field: ints, and floats with an integral value (``4096.0``)."""
    if isinstance(value, bool):
        return None, f"{key} must be an integer, got the boolean {json.dumps(value)}"
    if isinstance(value, int):
        return int(value), None
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value), None
        return None, f"{key} must be an integer, got {value!r}"
    # numpy integers and other integral numbers: accept through __index__, never strings.
    if not isinstance(value, (str, bytes)) and hasattr(type(value), "__index__"):
        return int(value.__index__()), None
    return None, f"{key} must be an integer, got {type(value).__name__} {value!r}"


def _check_bool(key: str, value: Any) -> tuple[bool | None, str | None]:
    """Accept only real booleans: ``"false"`` is truthy in Python and a bug in a config."""
    if isinstance(value, bool):
        return value, None
    if type(value).__name__ == "bool_":  # numpy.bool_, without importing numpy
        return bool(value), None
    if isinstance(value, str):
        return None, (f"{key} must be a JSON boolean (true or false), got the string "
                      f"{value!r}")
    return None, f"{key} must be a JSON boolean (true or false), got {type(value).__name__} " \
                 f"{value!r}"


def _check_range(key: str, value: int) -> str | None:
    if key == "block_size":
        # Any positive size works (DeepNVMe accepts any): handles round pieces to each
        # file's O_DIRECT alignment internally.
        if value <= 0:
            return f"block_size must be positive, got {value}"
        if value > MAX_BLOCK_SIZE:
            return (f"block_size must be at most {MAX_BLOCK_SIZE} (the kernel's largest "
                    f"single transfer), got {value}")
    elif key == "queue_depth":
        if not 1 <= value <= MAX_QUEUE_DEPTH:
            return f"queue_depth must be between 1 and {MAX_QUEUE_DEPTH}, got {value}"
    elif key == "intra_op_parallelism":
        if not 1 <= value <= MAX_PARALLELISM:
            return (f"intra_op_parallelism must be between 1 and {MAX_PARALLELISM}, "
                    f"got {value}")
    return None


def _validate(values: Mapping[Any, Any]) -> dict[str, Any]:
    """Check every key and value; return the normalised fields or raise one ConfigError."""
    problems: list[str] = []
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in _KEYS:
            problems.append(f"unknown key {key!r} in the {AIO_SECTION!r} section"
                            f"{_suggest(key)}")
            continue
        if key in _INT_KEYS:
            number, err = _check_int(key, value)
            if err is None:
                assert number is not None
                err = _check_range(key, number)
                out[key] = number
        else:
            out[key], err = _check_bool(key, value)
        if err is not None:
            problems.append(err)
    if problems:
        raise ConfigError("invalid aio config: " + "; ".join(problems))
    return out


@dataclass(frozen=True)
class AioConfig:
    """The ``"aio"`` section: how a handle cuts, queues and spreads its I/O.

    Parameters
    ----------
    block_size : int
        Bytes per kernel request; any positive size up to ``0x7FFFF000`` (pieces are
        rounded to each file's ``O_DIRECT`` alignment internally).
    queue_depth : int
        Requests in flight per AIO context, 1 to 65535.
    intra_op_parallelism : int
        Contiguous slices one request is split into, each on its own context; 1 to 256.
    single_submit : bool
        Submit one request per ``io_submit`` call instead of a batch.
    overlap_events : bool
        Keep the queue topped up while reaping (sliding window) instead of batch by batch.
    use_gds : bool
        Use GPUDirect Storage (cuFile) for CUDA tensors.

    Raises
    ------
    ConfigError
        A value has the wrong type (a bool or string where an integer belongs, a string
        where a boolean belongs, a non-integral float) or is out of range.

    Notes
    -----
    Integral floats such as ``4096.0`` are accepted and stored as ``int`` (JSON writers
    sometimes emit them); ``1.5`` is refused. Booleans are never accepted as integers and
    integers are never accepted as booleans.
    """

    block_size: int = 1 << 20
    queue_depth: int = 32
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False

    def __post_init__(self) -> None:
        fields = _validate({k: getattr(self, k) for k in _KEYS})
        for key, value in fields.items():
            if type(getattr(self, key)) is not type(value) or getattr(self, key) != value:
                object.__setattr__(self, key, value)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *,
                  defaults: AioConfig | None = None) -> AioConfig:
        """Read the section from ``{"aio": {...}}`` or from the inner dict itself.

        Parameters
        ----------
        d : Mapping
            Either a whole configuration holding an ``"aio"`` key (other top-level
            sections, e.g. the rest of a DeepSpeed config, are ignored) or the ``"aio"``
            section itself.
        defaults : AioConfig, optional
            Values of the keys the section leaves out. By default DeepSpeed's
            (:data:`DEEPSPEED_DEFAULTS`: queue depth 8), so a partial DeepSpeed section means
            what it means to DeepSpeed; pass :data:`DEFAULT_CONFIG` for aioswap's.

        Returns
        -------
        AioConfig

        Raises
        ------
        ConfigError
            ``d`` is not a mapping, has an unknown key (the message names the right one,
            e.g. ``num_threads`` → ``intra_op_parallelism``), a wrongly typed value or a
            value out of range. Every problem is listed in one message.
        """
        if not isinstance(d, Mapping):
            raise ConfigError(f"an aio config must be a mapping, got {type(d).__name__}")
        section: Any = d
        if AIO_SECTION in d:
            section = d[AIO_SECTION]
            if not isinstance(section, Mapping):
                raise ConfigError(f"the {AIO_SECTION!r} section must be a mapping, "
                                  f"got {type(section).__name__}")
        base = DEEPSPEED_DEFAULTS if defaults is None else defaults
        return cls(**{**base.to_dict(), **_validate(section)})

    def to_dict(self) -> dict[str, Any]:
        """The section as a plain dict: exactly the six keys, ints and real booleans."""
        return {k: getattr(self, k) for k in _KEYS}

    def to_json(self, *, wrap: bool = True, indent: int | None = 2) -> str:
        """The section as JSON, ``{"aio": {...}}`` when ``wrap`` (the default).

        Parameters
        ----------
        wrap : bool
            Wrap the section in ``{"aio": ...}`` so it pastes into a DeepSpeed config.
        indent : int or None
            Passed to :func:`json.dumps`; ``None`` gives one line.

        Returns
        -------
        str
            JSON with ``true``/``false`` booleans, readable by :meth:`from_json`.
        """
        body: dict[str, Any] = self.to_dict()
        return json.dumps({AIO_SECTION: body} if wrap else body, indent=indent)

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike[str]) -> AioConfig:
        """Read the section from JSON text or from a JSON file.

        Parameters
        ----------
        text_or_path : str or os.PathLike
            JSON text (a string starting with ``{``) or the path of a JSON file, holding
            ``{"aio": {...}}`` or the inner dict.

        Returns
        -------
        AioConfig

        Raises
        ------
        ConfigError
            The text is not valid JSON, is not an object, repeats a key, or fails
            :meth:`from_dict`.
        OSError
            The file cannot be read.
        """
        if isinstance(text_or_path, str) and text_or_path.lstrip().startswith("{"):
            text, source = text_or_path, "JSON text"
        else:
            path = os.fspath(text_or_path)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            source = repr(path)
        try:
            data = json.loads(text, object_pairs_hook=unique_keys)
        except ValueError as e:  # json.JSONDecodeError or a duplicate key
            raise ConfigError(f"cannot parse {source} as an aio config: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{source} must hold a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> AioConfig:
        """A copy with some fields changed, validated like :meth:`from_dict`.

        Raises
        ------
        ConfigError
            An unknown field name or an invalid value.
        """
        return type(self).from_dict({**self.to_dict(), **changes}, defaults=self)


#: aioswap's defaults: what handles, swappers and tools use when given no config (before the
#: ``AIOSWAP_*`` environment variables, see :func:`default_config`).
DEFAULT_CONFIG = AioConfig()

#: DeepSpeed's defaults for the ``"aio"`` section (``deepspeed/runtime/swap_tensor/constants.py``):
#: what :meth:`AioConfig.from_dict` gives the keys a section leaves out.
DEEPSPEED_DEFAULTS = AioConfig(block_size=1 << 20, queue_depth=8, intra_op_parallelism=1,
                               single_submit=False, overlap_events=True, use_gds=False)


# -- environment variables (KvikIO-style runtime defaults) -----------------------------------------
#: Every ``AIOSWAP_*`` variable: name, what it sets, accepted values, default.
ENVIRONMENT: tuple[tuple[str, str, str, str], ...] = (
    ("AIOSWAP_BLOCK_SIZE", "block_size of handles built without one", "size (4096, 512K, 1M)",
     "1M"),
    ("AIOSWAP_QUEUE_DEPTH", "queue_depth of handles built without one", "1..65535", "32"),
    ("AIOSWAP_INTRA_OP_PARALLELISM", "intra_op_parallelism of handles built without one",
     "1..256", "1"),
    ("AIOSWAP_SINGLE_SUBMIT", "single_submit of handles built without one", "0/1, true/false",
     "0"),
    ("AIOSWAP_OVERLAP_EVENTS", "overlap_events of handles built without one", "0/1, true/false",
     "1"),
    ("AIOSWAP_USE_GDS", "use_gds of the default config", "0/1, true/false", "0"),
    ("AIOSWAP_BUFFERED", "compat mode: serve every file with buffered I/O, no O_DIRECT",
     "0/1, true/false", "0"),
    ("AIOSWAP_POOL_SIZE", "bytes of a handle's bounce pool", "size (64M)",
     "min(2 x queue_depth x block_size, 64M)"),
    ("AIOSWAP_LOG_LEVEL", "level of the 'aioswap' logger", "DEBUG, INFO, WARNING, ERROR",
     "unset (logging's default)"),
    ("AIOSWAP_DEEPSPEED", "install the DeepSpeed op builders at interpreter start", "0/1", "0"),
)

_KNOB_VARS = (("AIOSWAP_BLOCK_SIZE", "block_size"), ("AIOSWAP_QUEUE_DEPTH", "queue_depth"),
              ("AIOSWAP_INTRA_OP_PARALLELISM", "intra_op_parallelism"),
              ("AIOSWAP_SINGLE_SUBMIT", "single_submit"),
              ("AIOSWAP_OVERLAP_EVENTS", "overlap_events"), ("AIOSWAP_USE_GDS", "use_gds"))
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _env_bool(name: str, text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(f"{name}={text!r}: expected 0/1, true/false, yes/no or on/off")


def _env_int(name: str, text: str, *, size: bool) -> int:
    try:
        return parse_size(text.strip(), what=name) if size else int(text.strip())
    except ValueError:
        kind = "a size such as 4096, 512K or 1M" if size else "an integer"
        raise ConfigError(f"{name}={text!r}: expected {kind}") from None


@dataclass(frozen=True)
class RuntimeSettings:
    """What the ``AIOSWAP_*`` environment variables ask for (see :data:`ENVIRONMENT`).

    Attributes
    ----------
    aio : AioConfig
        :data:`DEFAULT_CONFIG` with the knob variables applied.
    buffered : bool
        ``AIOSWAP_BUFFERED``: serve files with buffered I/O (no ``O_DIRECT``).
    pool_size : int or None
        ``AIOSWAP_POOL_SIZE`` in bytes; ``None`` when unset.
    log_level : str or None
        ``AIOSWAP_LOG_LEVEL``, upper case; ``None`` when unset.
    """

    aio: AioConfig
    buffered: bool = False
    pool_size: int | None = None
    log_level: str | None = None
    backend: str = "auto"


#: The engine's kernel interfaces (``AIOSWAP_BACKEND``, ``AioHandle(backend=...)``):
#: io_uring, kernel AIO, positional I/O on worker threads, or "auto" (kernel AIO, threads
#: where it is refused).
_BACKENDS = ("auto", "io_uring", "aio", "threads")


def runtime_settings(environ: Mapping[str, str] | None = None) -> RuntimeSettings:
    """Read the ``AIOSWAP_*`` variables (from ``os.environ`` by default).

    Raises
    ------
    ConfigError
        A variable has a bad value; the message names the variable, its value and what is
        accepted. Every problem is listed in one message.
    """
    env = os.environ if environ is None else environ
    knobs: dict[str, Any] = {}
    problems: list[str] = []
    for name, key in _KNOB_VARS:
        text = env.get(name)
        if text is None:
            continue
        try:
            knobs[key] = (_env_bool(name, text) if key in _BOOL_KEYS
                          else _env_int(name, text, size=key == "block_size"))
        except ConfigError as e:
            problems.append(str(e))
    buffered, pool, level = False, None, None
    try:
        buffered = _env_bool("AIOSWAP_BUFFERED", env.get("AIOSWAP_BUFFERED", "0"))
    except ConfigError as e:
        problems.append(str(e))
    try:        # read at interpreter start by the .pth hook; checked here so tools report it
        _env_bool("AIOSWAP_DEEPSPEED", env.get("AIOSWAP_DEEPSPEED", "0"))
    except ConfigError as e:
        problems.append(str(e))
    if env.get("AIOSWAP_POOL_SIZE") is not None:
        try:
            pool = _env_int("AIOSWAP_POOL_SIZE", env["AIOSWAP_POOL_SIZE"], size=True)
        except ConfigError as e:
            problems.append(str(e))
    if env.get("AIOSWAP_LOG_LEVEL"):
        level = env["AIOSWAP_LOG_LEVEL"].strip().upper()
        if level not in _LEVELS:
            problems.append(f"AIOSWAP_LOG_LEVEL={env['AIOSWAP_LOG_LEVEL']!r}: expected one of "
                            f"{', '.join(_LEVELS)}")
            level = None
    backend = env.get("AIOSWAP_BACKEND", "auto").strip().lower() or "auto"
    if backend not in _BACKENDS:
        problems.append(f"AIOSWAP_BACKEND={env['AIOSWAP_BACKEND']!r}: expected one of "
                        f"{', '.join(_BACKENDS)}")
        backend = "auto"
    aio = DEFAULT_CONFIG
    if not problems:
        try:
            aio = DEFAULT_CONFIG.replace(**knobs)
        except ConfigError as e:
            problems.append(f"from the AIOSWAP_* environment variables: {e}")
    if problems:
        raise ConfigError("; ".join(problems))
    return RuntimeSettings(aio=aio, buffered=buffered, pool_size=pool, log_level=level,
                           backend=backend)


def default_config(environ: Mapping[str, str] | None = None) -> AioConfig:
    """:data:`DEFAULT_CONFIG` with the ``AIOSWAP_*`` knob variables applied.

    Handles, swappers and tools built without a config should start from this.

    Raises
    ------
    ConfigError
        A variable has a bad value (see :func:`runtime_settings`).
    """
    return runtime_settings(environ).aio


def _apply_log_level() -> None:
    """``AIOSWAP_LOG_LEVEL`` sets the level of the ``aioswap`` logger (handlers are the
    application's business). A bad value does not break the import: it is left alone here
    and raised as :class:`ConfigError` by :func:`runtime_settings` (every handle, the tools)."""
    level = os.environ.get("AIOSWAP_LOG_LEVEL", "").strip().upper()
    if level in _LEVELS:
        logging.getLogger("aioswap").setLevel(level)


_apply_log_level()
