"""Device handles: every bad handle gets a precise error and leaves nothing mapped."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import pytest
import torch
from hicached_client.export import sealed_memfd

from hicached.errors import FailedPrecondition, InvalidArgument, NotFound
from hicached.shm import SharedSegment
from hicached.transfer import BufferSpec, CudaIpcBufferHandle, DeviceMappings, FdBufferHandle
from hicached.transfer.handles import (
    DTYPE_BY_NAME,
    NAME_BY_DTYPE,
    HandleOpener,
    Medium,
    OpenedAllocation,
    cuda_ipc_event_fence,
    register_opener,
    validate_spec,
)

SEG_BYTES = 64 * 1024


class Memfd(SharedSegment):
    """A worker-side sealed memfd and this test's own mapping of it (``fd`` stays open)."""

    fd: int


@pytest.fixture
def segment(unique: Callable[[str], str]) -> Iterator[Memfd]:
    name = unique("seg")
    fd = sealed_memfd(name, SEG_BYTES)
    mm = mmap.mmap(fd, SEG_BYTES, flags=mmap.MAP_SHARED)
    seg = Memfd(name, mm, SEG_BYTES, writable=True)
    seg.fd = fd
    yield seg
    seg.close()
    os.close(fd)


def maps_of(name: str) -> int:
    """How many memory mappings of memfd <name> this process holds."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if f"/memfd:{name} " in line)


def shm(seg: Memfd, offset: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float16) -> BufferSpec:
    size = dtype.itemsize
    for d in shape:
        size *= d
    return BufferSpec(FdBufferHandle(seg.fd, offset, size), shape, dtype)


BAD_FD: list[tuple[str, Callable[[int], BufferSpec], str]] = [
    ("size mismatch", lambda n: BufferSpec(FdBufferHandle(n, 0, 100), (4, 2, 8), torch.float16), "size 100"),
    ("misaligned", lambda n: BufferSpec(FdBufferHandle(n, 8, 128), (4, 2, 8), torch.float16), "offset 8"),
    ("negative offset", lambda n: BufferSpec(FdBufferHandle(n, -16, 128), (4, 2, 8), torch.float16), "-16"),
    ("empty shape", lambda n: BufferSpec(FdBufferHandle(n, 0, 0), (), torch.float16), "shape"),
    ("zero dim", lambda n: BufferSpec(FdBufferHandle(n, 0, 0), (4, 0, 8), torch.float16), "(4, 0, 8)"),
    ("float dim", lambda n: BufferSpec(FdBufferHandle(n, 0, 128), (4, 2.0, 8), torch.float16), "shape"),  # type: ignore[arg-type]
    ("list shape", lambda n: BufferSpec(FdBufferHandle(n, 0, 128), [4, 2, 8], torch.float16), "shape"),  # type: ignore[arg-type]
    ("float64", lambda n: BufferSpec(FdBufferHandle(n, 0, 512), (4, 2, 8), torch.float64), "float64"),
    ("not a dtype", lambda n: BufferSpec(FdBufferHandle(n, 0, 128), (4, 2, 8), "float16"), "dtype"),  # type: ignore[arg-type]
    (
        "negative fd",
        lambda n: BufferSpec(FdBufferHandle(-1, 0, 128), (4, 2, 8), torch.float16),
        "descriptor -1",
    ),
    (
        "beyond segment",
        lambda n: BufferSpec(FdBufferHandle(n, SEG_BYTES - 64, 128), (4, 2, 8), torch.float16),
        "exceeds",
    ),
    (
        "huge",
        lambda n: BufferSpec(FdBufferHandle(n, 0, 2 * SEG_BYTES), (SEG_BYTES,), torch.float16),
        "exceeds",
    ),
]


@pytest.mark.parametrize(("case", "make", "needle"), BAD_FD, ids=[c[0] for c in BAD_FD])
def test_bad_fd_handle_is_rejected_and_leaves_nothing_open(
    segment: Memfd, case: str, make: Callable[[int], BufferSpec], needle: str
) -> None:
    mappings = DeviceMappings()
    before = maps_of(segment.name)
    with pytest.raises(InvalidArgument) as info:
        mappings.open(make(segment.fd))
    assert needle in str(info.value), (case, str(info.value))
    assert mappings.open_count == 0
    assert maps_of(segment.name) == before  # nothing of the memfd stayed mapped
    mappings.close()


def _unsealed_memfd(name: str) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, SEG_BYTES)
    return fd


def _dev_shm_file(name: str) -> int:
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.unlink(path)
    os.ftruncate(fd, SEG_BYTES)
    return fd


def _read_only_memfd(name: str) -> int:
    fd = sealed_memfd(name, SEG_BYTES)
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    finally:
        os.close(fd)


def _closed_fd(name: str) -> int:
    fd = sealed_memfd(name, SEG_BYTES)
    os.close(fd)
    return fd


# Fds a worker could hand over that the daemon must not map: each can shrink under
# its mapping (SIGBUS), or cannot be mapped read-write.
BAD_KINDS: list[tuple[str, Callable[[str], int], str]] = [
    ("unsealed memfd", _unsealed_memfd, "seal it with F_SEAL_SHRINK"),
    ("/dev/shm file", _dev_shm_file, "seal it with F_SEAL_SHRINK"),
    ("read-only memfd", _read_only_memfd, "cannot be mapped read-write"),
    ("closed fd", _closed_fd, "not a memfd"),
]


@pytest.mark.parametrize(("case", "make", "needle"), BAD_KINDS, ids=[c[0] for c in BAD_KINDS])
def test_fd_that_could_shrink_or_cannot_be_written_is_refused(
    unique: Callable[[str], str], case: str, make: Callable[[str], int], needle: str
) -> None:
    name = unique("bad")
    fd = make(name)
    mappings = DeviceMappings()
    try:
        with pytest.raises(InvalidArgument, match=needle):
            mappings.open(BufferSpec(FdBufferHandle(fd, 0, 128), (4, 2, 8), torch.float16))
        assert mappings.open_count == 0
        assert maps_of(name) == 0
    finally:
        mappings.close()
        if case != "closed fd":
            os.close(fd)


def test_failed_open_keeps_earlier_mappings(segment: Memfd) -> None:
    mappings = DeviceMappings()
    good = mappings.open(shm(segment, 0, (4, 2, 8)))
    with pytest.raises(InvalidArgument):
        mappings.open(shm(segment, SEG_BYTES - 16, (4, 2, 8)))
    assert mappings.open_count == 1
    good.fill_(1.5)
    assert float(segment.tensor(torch.float16, (64,), 0).sum()) == 1.5 * 64
    del good
    mappings.close()


def test_buffers_in_one_segment_share_one_mapping_and_alias_its_memory(segment: Memfd) -> None:
    mappings = DeviceMappings()
    a, b = mappings.open_all([shm(segment, 0, (4, 2, 8)), shm(segment, 4096, (16, 16), torch.float32)])
    assert mappings.open_count == 1
    assert mappings.open(shm(segment, 4096 + 64, (8,), torch.float32)).data_ptr() == b.data_ptr() + 64
    assert mappings.open_count == 1  # a later buffer inside the mapped span reuses it
    assert a.shape == (4, 2, 8) and a.dtype == torch.float16
    assert b.shape == (16, 16) and b.dtype == torch.float32
    b.copy_(torch.arange(256, dtype=torch.float32).view(16, 16))
    assert torch.equal(segment.tensor(torch.float32, (256,), 4096), torch.arange(256, dtype=torch.float32))
    del a, b
    mappings.close()
    assert mappings.open_count == 0


def test_close_is_idempotent_and_final(segment: Memfd) -> None:
    mappings = DeviceMappings()
    view = mappings.open(shm(segment, 0, (4, 2, 8)))
    del view
    assert maps_of(segment.name) == 2  # the test's own mapping and the session's
    mappings.close()
    mappings.close()
    assert maps_of(segment.name) == 1
    with pytest.raises(FailedPrecondition, match="closed"):
        mappings.open(shm(segment, 0, (4, 2, 8)))
    assert mappings.open_count == 0


def rss_of_mapping_at(address: int) -> int:
    """Bytes of the mapping holding ``address`` that have page-table entries in this process."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:  # a mapping header, not a field line
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_backed_memfd_is_populated_at_open_so_copies_take_no_faults(segment: Memfd) -> None:
    # sealed_memfd reserves every page: the daemon's new mapping gets all of them
    # at open, none are faulted in later by the first copy.
    mappings = DeviceMappings()
    view = mappings.open(shm(segment, 0, (SEG_BYTES // 2,)))
    assert rss_of_mapping_at(view.data_ptr()) == SEG_BYTES
    del view
    mappings.close()


def test_sparse_memfd_is_not_populated_and_gains_no_memory(unique: Callable[[str], str]) -> None:
    # Populating a sparse file would allocate memory the worker never held.
    import fcntl

    fd = os.memfd_create(unique("sparse"), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, SEG_BYTES)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        mappings = DeviceMappings()
        view = mappings.open(BufferSpec(FdBufferHandle(fd, 0, SEG_BYTES), (SEG_BYTES // 2,), torch.float16))
        assert rss_of_mapping_at(view.data_ptr()) == 0
        assert os.fstat(fd).st_blocks == 0
        view[0] = 1.0  # still usable: pages fault in as written
        assert os.fstat(fd).st_blocks > 0
        del view
        mappings.close()
    finally:
        os.close(fd)


def test_concurrent_opens_map_a_segment_once(segment: Memfd) -> None:
    mappings = DeviceMappings()
    start = threading.Barrier(8)
    views: list[torch.Tensor] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        start.wait()
        # Each attach hands over all its buffers; the mapping is shared across calls.
        v = mappings.open_all([shm(segment, 256 * j, (8, 8)) for j in range(8)])[i]
        with lock:
            views.append(v)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(views) == 8
    assert mappings.open_count == 1
    views.clear()
    mappings.close()


GOOD_IPC = bytes(range(1, 65))
BAD_IPC: list[tuple[str, CudaIpcBufferHandle, str]] = [
    ("short handle", CudaIpcBufferHandle(GOOD_IPC[:63], 0, 0, 128), "64 bytes, got 63"),
    ("long handle", CudaIpcBufferHandle(GOOD_IPC + b"x", 0, 0, 128), "64 bytes, got 65"),
    ("str handle", CudaIpcBufferHandle("x" * 64, 0, 0, 128), "got str"),  # type: ignore[arg-type]
    ("zero handle", CudaIpcBufferHandle(bytes(64), 0, 0, 128), "all zero"),
    ("negative device", CudaIpcBufferHandle(GOOD_IPC, -1, 0, 128), "device id -1"),
    ("size mismatch", CudaIpcBufferHandle(GOOD_IPC, 0, 0, 127), "size 127"),
    ("misaligned", CudaIpcBufferHandle(GOOD_IPC, 0, 4, 128), "offset 4"),
]


@pytest.mark.parametrize(("case", "handle", "needle"), BAD_IPC, ids=[c[0] for c in BAD_IPC])
def test_bad_cuda_ipc_handle_is_rejected_without_touching_cuda(
    case: str, handle: CudaIpcBufferHandle, needle: str
) -> None:
    mappings = DeviceMappings()
    with pytest.raises(InvalidArgument) as info:
        mappings.open(BufferSpec(handle, (4, 2, 8), torch.float16))
    assert needle in str(info.value), (case, str(info.value))
    assert mappings.open_count == 0


def test_unknown_handle_type_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="unsupported device handle type str"):
        validate_spec(BufferSpec("shm:x", (4,), torch.float16))  # type: ignore[arg-type]


def test_cuda_event_fence_validates_handle_length() -> None:
    with pytest.raises(InvalidArgument, match="64 bytes, got 3"):
        cuda_ipc_event_fence(b"abc", 0)


def test_dtype_name_maps_are_inverse_and_cover_the_wire_types() -> None:
    assert set(DTYPE_BY_NAME) == {
        "float16",
        "bfloat16",
        "float32",
        "float8_e4m3fn",
        "float8_e5m2",
        "uint8",
        "int8",
    }
    for name, dtype in DTYPE_BY_NAME.items():
        assert NAME_BY_DTYPE[dtype] == name


@dataclass(frozen=True)
class HeapHandle:
    """A test-only handle kind: a byte range of a process-local tensor."""

    name: str
    offset: int
    size: int


class HeapAllocation(OpenedAllocation):
    def __init__(self, closes: list[str], name: str) -> None:
        self._buf = torch.zeros(4096, dtype=torch.uint8)
        self._closes = closes
        self._name = name

    @property
    def size(self) -> int:
        return 4096

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        return self._buf[offset : offset + nbytes].view(dtype).view(shape)

    def close(self) -> None:
        self._closes.append(self._name)


class HeapOpener(HandleOpener[HeapHandle]):
    medium = Medium.CPU

    def __init__(self) -> None:
        self.closes: list[str] = []

    def key(self, handle: HeapHandle) -> Hashable:
        return ("heap", handle.name)

    def open(self, handle: HeapHandle) -> OpenedAllocation:
        return HeapAllocation(self.closes, handle.name)


def test_registered_opener_kind_is_used_and_each_allocation_closed_exactly_once() -> None:
    opener = HeapOpener()
    register_opener(HeapHandle, opener)
    mappings = DeviceMappings()
    a = mappings.open(BufferSpec(HeapHandle("a", 0, 64), (32,), torch.float16))  # type: ignore[arg-type]
    b = mappings.open(BufferSpec(HeapHandle("a", 64, 64), (32,), torch.float16))  # type: ignore[arg-type]
    c = mappings.open(BufferSpec(HeapHandle("b", 0, 64), (32,), torch.float16))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="exceeds"):
        mappings.open(BufferSpec(HeapHandle("c", 4096 - 16, 64), (32,), torch.float16))  # type: ignore[arg-type]
    assert opener.closes == ["c"]  # the failed fresh mapping was closed at once
    a.fill_(1)
    assert float(b.sum()) == 0 and a.shape == c.shape == (32,)
    mappings.close()
    mappings.close()
    assert sorted(opener.closes) == ["a", "b", "c"]


def test_well_formed_cuda_handle_that_cannot_be_opened_leaves_nothing_open() -> None:
    # Without CUDA: FailedPrecondition (no device); with CUDA: the driver refuses a made-up handle.
    mappings = DeviceMappings()
    spec = BufferSpec(CudaIpcBufferHandle(GOOD_IPC, 0, 0, 128), (4, 2, 8), torch.float16)
    expected = FailedPrecondition if not torch.cuda.is_available() else (FailedPrecondition, NotFound)
    with pytest.raises(expected):
        mappings.open(spec)
    assert mappings.open_count == 0
    mappings.close()


TIB = 1 << 40


@pytest.fixture
def sparse_tib(unique: Callable[[str], str]) -> Iterator[tuple[str, int]]:
    """A sealed memfd ftruncated to 1 TiB that holds no memory: a file size that costs a client nothing."""
    import fcntl

    name = unique("sparse-tib")
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, TIB)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        yield name, fd
    finally:
        os.close(fd)


def mapped_bytes_of(name: str) -> list[int]:
    """The length of every mapping of memfd <name> in this process."""
    sizes = []
    with open("/proc/self/maps") as f:
        for line in f:
            if f"/memfd:{name} " in line:
                lo, hi = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
                sizes.append(hi - lo)
    return sizes


def test_only_the_span_the_buffers_use_of_a_huge_sparse_memfd_is_mapped(sparse_tib: tuple[str, int]) -> None:
    # Mapping the whole file let a client take the daemon's address space at no cost
    # (a 64 TiB sparse memfd per attach), until mmap and thread starts failed for all.
    name, fd = sparse_tib
    a, b = (BufferSpec(FdBufferHandle(fd, off, 4096), (2048,), torch.float16) for off in (0, 64 << 10))
    mappings = DeviceMappings()
    try:
        va, vb = mappings.open_all([a, b])
        assert mapped_bytes_of(name) == [(64 << 10) + 4096]  # one mapping, the span [0, 68 KiB)
        assert mappings.open_count == 1
        va.copy_(torch.arange(2048, dtype=torch.float16))
        os.pwrite(fd, torch.full((2048,), 3.0, dtype=torch.float16).numpy().tobytes(), 64 << 10)
        assert os.pread(fd, 4096, 0) == torch.arange(2048, dtype=torch.float16).numpy().tobytes()
        assert bool((vb == 3.0).all())
        # A buffer ending past the file is still refused, and maps nothing.
        with pytest.raises(InvalidArgument, match=f"exceeds its allocation of {TIB} bytes"):
            mappings.open(BufferSpec(FdBufferHandle(fd, TIB - 16, 32), (16,), torch.float16))
        assert mappings.open_count == 1 and len(mapped_bytes_of(name)) == 1
        del va, vb
    finally:
        mappings.close()
    assert mapped_bytes_of(name) == []


def test_buffers_far_apart_in_one_memfd_are_mapped_separately_not_across_the_gap(
    sparse_tib: tuple[str, int],
) -> None:
    # The span [min offset, max end) of two buffers at 0 and near 1 TiB is the whole
    # file again; each run of nearby buffers gets its own mapping instead.
    name, fd = sparse_tib
    far = TIB - (1 << 20) + 48  # not on a page boundary: the mapping starts at the page below
    specs = [BufferSpec(FdBufferHandle(fd, off, 64), (32,), torch.float16) for off in (0, far)]
    mappings = DeviceMappings()
    try:
        near_view, far_view = mappings.open_all(specs)
        assert sorted(mapped_bytes_of(name)) == [4096, 4096]
        assert mappings.open_count == 2
        far_view.fill_(7.0)
        near_view.fill_(1.0)
        assert os.pread(fd, 64, far) == torch.full((32,), 7.0, dtype=torch.float16).numpy().tobytes()
        assert os.pread(fd, 64, 0) == torch.ones(32, dtype=torch.float16).numpy().tobytes()
        del near_view, far_view
    finally:
        mappings.close()
    assert mapped_bytes_of(name) == []
