"""Host memory the agent can map, and how a tensor becomes a region.

A SharedBuffer is a memfd (the agent's sealed one from AllocateMemory, or the
engine's own from os.memfd_create, shared by descriptor), mapped MAP_SHARED here; its
tensor()/numpy()/empty() give views of it. A CPU tensor can be registered only if its
bytes lie in such a buffer of the same client: the agent maps memory by descriptor,
never by address, so ordinary process memory cannot be registered. A CUDA tensor is
registered by the CUDA IPC handle of its allocation (torch's caching allocator block).

tensor_layout() reads item size, stride and count from a tensor (pages or slots along
one dimension); nothing is computed by the caller.
"""
import mmap
import os

import numpy as np

from . import errors
from ._proto import kvagent_pb2 as pb

try:
    import torch
except ImportError:  # numpy-only use
    torch = None

ALIGN = 4096


class SharedBuffer:
    """A mapped memfd known to the agent by `handle` (this session only)."""

    def __init__(self, info, fd, owned_by_agent):
        self.info = info
        self.handle = info.handle
        self.size = info.bytes
        self.label = info.label
        self.fd = fd
        self.owned_by_agent = owned_by_agent
        self._mmap = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._bytes = np.frombuffer(self._mmap, dtype=np.uint8)
        self.address = self._bytes.ctypes.data
        self._next = 0

    def contains(self, address, nbytes):
        return self.address <= address and address + nbytes <= self.address + self.size

    def numpy(self, shape, dtype, offset=0):
        """A numpy view of `shape` x `dtype` at byte `offset`."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape)) if len(shape) else 1
        self._check_span(offset, count * dtype.itemsize)
        return self._bytes[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)

    def tensor(self, shape, dtype, offset=0):
        """A torch view of `shape` x `dtype` at byte `offset` (shares the memory)."""
        if torch is None:
            raise errors.invalid(self.label, "torch is not installed", "install python3-torch")
        count = 1
        for d in shape:
            count *= int(d)
        itemsize = torch.empty((), dtype=dtype).element_size()
        self._check_span(offset, count * itemsize)
        flat = torch.frombuffer(self._mmap, dtype=torch.uint8, count=count * itemsize,
                                offset=offset)
        return flat.view(dtype).view(tuple(shape))

    def empty(self, shape, dtype):
        """The next free, 4 KiB-aligned piece of the buffer as a tensor (uninitialized)."""
        start = self._next
        view = self.tensor(shape, dtype, start)
        nbytes = view.numel() * view.element_size()
        self._next = (start + nbytes + ALIGN - 1) // ALIGN * ALIGN
        return view

    def _check_span(self, offset, nbytes):
        if offset < 0 or offset + nbytes > self.size:
            raise errors.invalid(
                f"buffer '{self.label}'",
                f"{nbytes} bytes at offset {offset} do not fit its {self.size} bytes",
                "allocate a larger buffer (or more buffers)")

    def close(self):
        self._bytes = None
        try:
            self._mmap.close()
        except BufferError:
            pass  # views still exist; the mapping goes when they do
        os.close(self.fd)


class Layout:
    """Where a tensor's items are: the source (memory handle or CUDA IPC handle) and
    num_items x item_bytes, item_stride apart, from byte `offset`."""

    def __init__(self, name, num_items, item_bytes, item_stride, dtype, device):
        self.name = name
        self.num_items = num_items
        self.item_bytes = item_bytes
        self.item_stride = item_stride
        self.dtype = dtype
        self.device = device
        self.length = (num_items - 1) * item_stride + item_bytes
        self.memory = pb.DRAM
        self.source = None  # set by Client: ("shm", handle, offset) or ("cuda_ipc", ...)

    def fill(self, spec):
        spec.memory = self.memory
        spec.length = self.length
        spec.layout.num_items = self.num_items
        spec.layout.item_bytes = self.item_bytes
        spec.layout.item_stride = self.item_stride
        kind, *rest = self.source
        if kind == "shm":
            spec.shm.memory_handle, spec.shm.offset = rest
        else:
            spec.cuda_ipc.ipc_handle, spec.cuda_ipc.device, spec.cuda_ipc.offset = rest


class Raw:
    """Memory named by address, as SGLang's KVArgs gives it (data pointer, bytes, item
    bytes): items packed from `address`. It must lie in a buffer of the client."""

    def __init__(self, address, nbytes, item_bytes):
        if item_bytes <= 0 or nbytes < item_bytes:
            raise errors.invalid(f"memory at 0x{address:x}", f"{nbytes} bytes of {item_bytes}-byte "
                                 "items hold no item", "give the length and item size in bytes")
        self.address, self.nbytes, self.item_bytes = address, nbytes, item_bytes


def _describe(tensor):
    """(address, shape, byte strides, itemsize, dtype name, device) of a torch tensor or
    numpy array."""
    if torch is not None and isinstance(tensor, torch.Tensor):
        size = tensor.element_size()
        return (tensor.data_ptr(), tuple(tensor.shape), tuple(s * size for s in tensor.stride()),
                size, str(tensor.dtype).replace("torch.", ""), str(tensor.device))
    if isinstance(tensor, Raw):
        return (tensor.address, (tensor.nbytes // tensor.item_bytes, tensor.item_bytes),
                (tensor.item_bytes, 1), 1, "bytes", "cpu")
    if isinstance(tensor, np.ndarray):
        return (tensor.ctypes.data, tuple(tensor.shape), tuple(tensor.strides),
                tensor.itemsize, str(tensor.dtype), "cpu")
    raise errors.invalid(f"{type(tensor).__name__} object", "is not a torch tensor or numpy array",
                         "pass the tensor (or numpy array) that holds the pages or slots")


def tensor_layout(name, tensor):
    """The Layout of `tensor` with its items along dimension 0. Every dimension after
    the first must be contiguous (an item is one run of bytes); the first may have any
    stride not below the item size."""
    address, shape, strides, itemsize, dtype, device = _describe(tensor)
    if len(shape) == 0 or shape[0] == 0:
        raise errors.invalid(name, f"shape {list(shape)} has no items along dimension 0",
                             "pass a tensor with pages (or slots) along its first dimension")
    expected = itemsize
    for dim in range(len(shape) - 1, 0, -1):
        if shape[dim] != 1 and strides[dim] != expected:
            raise errors.invalid(
                name, f"is not contiguous after dimension 0 (shape {list(shape)}, strides in "
                f"bytes {list(strides)}): one page or slot must be one run of bytes",
                "pass a tensor whose dimensions after the first are contiguous (allocate it "
                "in that layout; .contiguous() would copy it out of the registered memory)")
        expected *= shape[dim]
    item_bytes = expected
    stride = strides[0] if shape[0] > 1 else item_bytes
    if stride < item_bytes:
        raise errors.invalid(
            name, f"items overlap: dimension 0 stride {stride} bytes < item size {item_bytes}",
            "pass a tensor whose pages (or slots) do not overlap")
    layout = Layout(name, shape[0], item_bytes, stride, dtype, device)
    layout.address = address
    return layout


def cuda_ipc_source(name, tensor, layout):
    """("cuda_ipc", handle, device, offset) of a CUDA tensor: its caching-allocator
    block's CUDA IPC handle and the tensor's first byte inside that block."""
    storage = tensor.storage()
    shared = storage._share_cuda_()
    device, handle, _, storage_offset = shared[0], shared[1], shared[2], shared[3]
    if not isinstance(handle, bytes) or len(handle) != 64:
        raise errors.invalid(name, "torch gave no 64-byte CUDA IPC handle for its storage",
                             "allocate the cache with torch's default CUDA allocator")
    offset = storage_offset + (tensor.data_ptr() - storage.data_ptr())
    layout.memory = pb.VRAM
    return ("cuda_ipc", handle, device, offset)
