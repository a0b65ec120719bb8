"""Compatibility layers with other projects' APIs.

* :mod:`aioswap.compat.deepnvme`: DeepSpeed DeepNVMe's ``aio_handle``/``gds_handle``/
  ``pin_handle`` and module functions on aioswap.
* :mod:`aioswap.compat.deepspeed`: ``install()`` makes DeepSpeed's op builders load them
  (also at interpreter start with ``AIOSWAP_DEEPSPEED=1``).

Nothing here is imported by ``import aioswap``.
"""
