"""GdsHandle: import and fail cleanly without CUDA; real round trips where a GPU is present."""
from __future__ import annotations

import os

import pytest
import torch

import aioswap
from aioswap import _cufile
from aioswap.compat import deepnvme

HAVE_CUDA = torch.cuda.is_available()
HAVE_CUFILE = _cufile.available()[0]
needs_gds = pytest.mark.skipif(not (HAVE_CUDA and HAVE_CUFILE),
                               reason=f"needs a CUDA device ({HAVE_CUDA}) and libcufile "
                                      f"({_cufile.available()[1] or 'found'})")
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA device")


@pytest.mark.skipif(HAVE_CUDA and HAVE_CUFILE, reason="cuFile and a GPU are present")
def test_gds_handle_unavailable_is_clear():
    with pytest.raises(aioswap.CuFileUnavailable) as info:
        aioswap.GdsHandle()
    msg = str(info.value)
    assert ("libcufile" in msg) or ("CUDA device" in msg)
    with pytest.raises(aioswap.CuFileUnavailable):
        deepnvme.gds_handle()


@pytest.mark.gpu
@needs_cuda
def test_cuda_tensor_through_aio_bounce(tmp_path):
    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, device="cuda")
    with aioswap.AioHandle(block_size=1 << 20, queue_depth=8) as h:
        h.pwrite(src, tmp_path / "c.bin", 4097)
        out = torch.empty_like(src)
        h.pread(out, tmp_path / "c.bin", 4097)
        assert h.stats.bounce_bytes > 0
    assert torch.equal(out, src)
    with open(tmp_path / "c.bin", "rb") as f:
        f.seek(4097)
        assert f.read() == src.cpu().numpy().tobytes()


@pytest.mark.cufile
@needs_gds
@pytest.mark.parametrize("registered", [False, True])
def test_gds_round_trip(tmp_path, registered):
    n = 8 << 20
    with aioswap.GdsHandle() as g:
        src = g.new_pinned_device_tensor(n, torch.uint8) if registered else torch.empty(
            n, dtype=torch.uint8, device="cuda")
        src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda"))
        g.pwrite(src, tmp_path / "g.bin")
        out = torch.empty_like(src)
        g.pread(out, tmp_path / "g.bin")
        assert torch.equal(out, src)
        with open(tmp_path / "g.bin", "rb") as f:
            assert f.read() == src.cpu().numpy().tobytes()
        if registered:
            g.unpin_device_tensor(src)
    assert os.path.getsize(tmp_path / "g.bin") == n
