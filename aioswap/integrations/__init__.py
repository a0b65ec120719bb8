"""Drop-ins for the libraries users already run, reading and writing through aioswap.

* :mod:`aioswap.integrations.accelerate`: ``install()`` replaces accelerate's
  ``OffloadedWeightsLoader``, so ``from_pretrained(..., device_map=...)`` with disk entries,
  ``accelerate.dispatch_model`` and ``accelerate.disk_offload`` read offloaded weights with
  batched direct I/O.
* :mod:`aioswap.integrations.diffusers`: ``install()`` makes diffusers' group offloading to
  disk write, verify and read its group files through aioswap.
* :mod:`aioswap.integrations.transformers`: ``install()`` makes ``from_pretrained`` of a
  local safetensors checkpoint read every shard through :mod:`aioswap.safetensors`, in one
  stream, handing transformers each tensor as it lands.

Nothing here is imported by ``import aioswap``, and no module here imports transformers,
accelerate or diffusers before its ``install()`` is called.
"""
