"""Drop-ins for the libraries users already run, reading and writing through aioswap.

* :mod:`aioswap.integrations.accelerate`: ``install()`` replaces accelerate's
  ``OffloadedWeightsLoader``, so ``from_pretrained(..., device_map=...)`` with disk entries,
  ``accelerate.dispatch_model`` and ``accelerate.disk_offload`` read offloaded weights with
  batched direct I/O.

Nothing here is imported by ``import aioswap``, and no module here imports transformers,
accelerate or diffusers before its ``install()`` is called.
"""
