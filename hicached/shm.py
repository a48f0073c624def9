"""Named POSIX shared-memory segments whose lifetime the daemon owns explicitly.

A segment is a file under ``/dev/shm`` mapped with ``mmap``. Unlike
``multiprocessing.shared_memory`` nothing here registers the name with a
resource tracker, so a segment outlives the process that created it until
someone calls :meth:`SharedSegment.unlink` -- which is exactly what a warm
restart needs: the next daemon re-maps the same name and finds its pages.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import math
import mmap
import os
import stat
import sys
import warnings

import numpy as np
import torch

from hicached.errors import AlreadyExists, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
OS_PAGE = 4096
_MADV_POPULATE_READ = 22
_MADV_POPULATE_WRITE = 23
MAX_NAME_BYTES = 200  # of the file name's bytes (os.fsencode): tmpfs takes 255 at most


def name_is_valid(name: str) -> bool:
    """Whether ``name`` can name a segment: 1..MAX_NAME_BYTES bytes, no '/' or NUL, not '.' or '..'.

    Bytes, not characters: a name within 200 characters but past the file system's 255
    bytes passed a count of characters, and then failed with an OSError.
    """
    try:
        size = len(os.fsencode(name))
    except UnicodeEncodeError:  # a lone surrogate: no file name
        return False
    return 0 < size <= MAX_NAME_BYTES and "/" not in name and "\0" not in name and name not in (".", "..")


def _path_for(name: str) -> str:
    if not name_is_valid(name):
        raise InvalidArgument(
            f"shared memory segment name {name!r} is invalid: use 1..{MAX_NAME_BYTES} bytes without '/' or NUL"
        )
    return os.path.join(SHM_DIR, name)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_libc.mremap.restype = ctypes.c_void_p  # variadic in C; its fifth argument is the new address
_libc.mremap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
# Linux's values (x86_64, aarch64); the mmap module exports none of them.
_MAP_NORESERVE = 0x4000
_MREMAP_MAYMOVE = 1
_MREMAP_FIXED = 2
_MAP_FAILED = ctypes.c_void_p(-1).value
# Placeholders whose range a failed move may have left to others: never unmapped (see map_file).
_STRANDED: list[mmap.mmap] = []


def map_file(
    fd: int, length: int, *, offset: int = 0, prot: int = mmap.PROT_READ | mmap.PROT_WRITE
) -> mmap.mmap:
    """``length`` bytes of ``fd`` from ``offset`` (a multiple of ``mmap.ALLOCATIONGRANULARITY``),
    ``MAP_SHARED``, as an :class:`mmap.mmap` that keeps no descriptor: the caller may close
    ``fd`` at once. Raises OSError as ``mmap.mmap`` does.

    Why: ``mmap.mmap(fd, ...)`` keeps a duplicate of ``fd`` for its whole life (before Python
    3.13 nothing turns that off), so each mapping of a client's memfd held one of the daemon's
    descriptors: one client mapping many far-apart buffers ran the daemon out of them, and
    every other client's attach failed (EMFILE). How: anonymous memory of ``length`` bytes,
    mapped by ``mmap.mmap`` (which then owns the address range: it counts the buffer views
    it hands out, and its ``close()`` unmaps the range whatever backs it); the file mapped
    where the kernel likes (what a client's memfd can make fail, a seal or its mode, fails
    there, with nothing of ours replaced); then that mapping moved over the placeholder
    (``mremap`` with ``MREMAP_FIXED``). The anonymous memory is never touched and
    ``MAP_NORESERVE`` keeps it off the commit limit (under ``vm.overcommit_memory = 2`` the
    kernel charges it until the file replaces it: a span larger than what is left fails with
    ENOMEM there). Thread-safe; the caller owns the mapping."""
    placeholder = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE, prot=prot)
    file_map = _libc.mmap(None, length, prot, mmap.MAP_SHARED, fd, offset)
    if file_map == _MAP_FAILED:
        err = ctypes.get_errno()
        placeholder.close()
        raise OSError(err, os.strerror(err))
    probe = np.frombuffer(placeholder, dtype=np.uint8, count=1)  # read-only ones too
    address = probe.ctypes.data
    del probe  # a view left would keep close() from unmapping
    moved = _libc.mremap(file_map, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, address)
    if moved != address:
        # Only the kernel's own want of memory gets here, perhaps after it unmapped the
        # placeholder's range, where other threads may map meanwhile: closing the placeholder
        # could unmap their memory, so it is kept (its range is lost, not reused).
        err = ctypes.get_errno()
        _libc.munmap(file_map, length)
        _STRANDED.append(placeholder)
        raise OSError(err, os.strerror(err))
    return placeholder


def _madvise(mm: mmap.mmap, option: int) -> bool:
    """Best-effort madvise; False when the kernel or platform refuses the option."""
    if option in (_MADV_POPULATE_READ, _MADV_POPULATE_WRITE):
        return _populate(mm, option)
    try:
        mm.madvise(option)
    except (OSError, ValueError, AttributeError):
        return False
    return True


# Populated per call: the kernel holds the process's mmap lock while it populates, and any
# thread that maps or unmaps memory meanwhile (malloc does, for large blocks) waits for it,
# then every thread behind that one: one 2 GiB call held the event loop for seconds.
_POPULATE_CHUNK = 32 << 20


def _populate(mm: mmap.mmap, option: int) -> bool:
    """A populating madvise through libc, a chunk per call: ``mmap.madvise`` holds the GIL
    for the whole call, and populating GiBs takes seconds, in which no other thread of the
    daemon (its event loop included) ran; a foreign call through ctypes releases it, and
    chunks release the kernel's mmap lock (see :data:`_POPULATE_CHUNK`)."""
    import ctypes  # only pools being built and memfds being attached need it

    if len(mm) == 0:
        return True
    try:
        view = (ctypes.c_char * len(mm)).from_buffer(mm)
    except (TypeError, ValueError):  # a read-only mapping: mmap's own call
        try:
            mm.madvise(option)
        except (OSError, ValueError, AttributeError):
            return False
        return True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        base, size = ctypes.addressof(view), len(mm)
        for at in range(0, size, _POPULATE_CHUNK):
            n = min(_POPULATE_CHUNK, size - at)
            if libc.madvise(ctypes.c_void_p(base + at), ctypes.c_size_t(n), option) != 0:
                return False
    finally:
        del view  # the export would keep mm from closing
    return True


def _prefault(mm: mmap.mmap, size: int, *, write: bool) -> None:
    """Fault every page in now, so the first copy into the pool runs at memcpy speed.

    ``MADV_POPULATE_WRITE`` (Linux 5.14+) maps pages writable without changing
    their contents. The fallback touches one byte per 4 KiB page: writing zero is
    only safe on a freshly created (all-zero) segment, so a re-opened segment
    falls back to reading.
    """
    if hasattr(mmap, "MADV_HUGEPAGE"):
        _madvise(mm, mmap.MADV_HUGEPAGE)
    if _madvise(mm, _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ):
        return
    view = np.frombuffer(mm, dtype=np.uint8, count=size)
    try:
        if write:
            view[::OS_PAGE] = 0
        else:
            int(view[::OS_PAGE].sum())
    finally:
        del view


TMPFS_MAGIC = 0x01021994  # memfd_create without MFD_HUGETLB, /dev/shm
_STATFS_BYTES = 256  # struct statfs is 120 bytes on 64-bit Linux; f_type (a long) comes first


def fs_type(fd: int) -> int:
    """The ``f_type`` of the file system holding ``fd`` (``fstatfs``); OSError as the kernel says."""
    import ctypes  # only the memfd checks at attach need it

    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if libc.fstatfs(ctypes.c_int(fd), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int.from_bytes(
        buf.raw[: ctypes.sizeof(ctypes.c_long)], "little" if sys.byteorder == "little" else "big"
    )


def populate_backed(mm: mmap.mmap, st: os.stat_result) -> bool:
    """Map every page of ``mm`` (a span of a handed-over memfd) into this process now, if the
    whole file is backed.

    A worker's pool memfd is already backed (the worker wrote it), but the
    daemon's fresh mapping of it has no page-table entries, so the first copy
    into each 4 KiB page takes a minor fault: a warm L2 -> worker copy ran at
    half of memcpy speed until every page had been touched once. Populating at
    attach moves that cost out of the data path. Only a fully backed file is
    populated (``st_blocks`` covers ``st_size``), so this allocates no memory the
    worker did not already hold; a sparse memfd is left to fault lazily. Why the
    whole file and not just the span: ``SEEK_HOLE`` on tmpfs reports pages that
    ``fallocate`` reserved but nobody wrote as a hole (measured on Linux 6.18), so
    it would skip exactly the sealed, reserved memfds workers hand over; a file
    backed whole is backed in every span. Only ``mm`` -- the mapped span -- is
    populated. True when the kernel populated the mapping.
    """
    if st.st_blocks * 512 < st.st_size:
        return False
    return _madvise(mm, _MADV_POPULATE_WRITE)


class SharedSegment:
    """One mapped ``/dev/shm`` segment.

    Thread-safety: the mapping itself may be read and written from any thread;
    :meth:`close` and :meth:`unlink` must not race with each other (the owning
    pool calls them once, at shutdown).

    Buffer ownership: the segment owns the mapping. :attr:`buf` and
    :meth:`tensor` hand out zero-copy views that keep the mapping alive; after
    :meth:`close` the mapping is unmapped as soon as the last such view is
    garbage-collected, so a stale view never dangles. The name (the file in
    ``/dev/shm``) lives until :meth:`unlink`, independently of any process.
    """

    def __init__(self, name: str, mm: mmap.mmap, size: int, writable: bool) -> None:
        self.name = name
        self.size = size
        self.writable = writable
        self._mmap: mmap.mmap | None = mm
        self._buf: memoryview | None = memoryview(mm)

    @classmethod
    def create(cls, name: str, size: int, *, prefault: bool = True) -> SharedSegment:
        """Create and map a new segment of ``size`` bytes (zero-filled).

        Raises AlreadyExists if the name is taken, InvalidArgument for a bad
        name or size, ResourceExhausted when ``/dev/shm`` cannot hold it. On any
        error nothing is left behind.
        """
        path = _path_for(name)
        if not isinstance(size, int) or size <= 0:
            raise InvalidArgument(f"segment size must be a positive number of bytes, got {size!r}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            raise AlreadyExists(f"shared memory segment {name!r} already exists") from None
        try:
            try:
                # Reserve the memory now: a later SIGBUS in the middle of a copy is
                # far worse than a clear error at creation.
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise ResourceExhausted(
                        f"cannot reserve {size} bytes for segment {name!r} in {SHM_DIR}: {exc.strerror}"
                    ) from None
                raise
            mm = map_file(fd, size)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        os.close(fd)
        if prefault:
            _prefault(mm, size, write=True)
        logger.debug("created shm segment %s (%d bytes)", name, size)
        return cls(name, mm, size, writable=True)

    @classmethod
    def open(cls, name: str, *, writable: bool = True, prefault: bool = False) -> SharedSegment:
        """Map an existing segment of the daemon's own (warm restart). Never a client's: workers
        hand their buffers over as fds (see hicached.transfer.handles).

        Raises NotFound if no segment has this name, PermissionDenied for a symlink, a
        segment another user owns (planted to make the daemon map a file it chose) or one with
        a second name (a hard link: two groups would share its pages).
        """
        path = _path_for(name)
        try:
            fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise NotFound(f"shared memory segment {name!r} does not exist") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise PermissionDenied(
                    f"shared memory segment {name!r} is a symlink; refusing to follow it"
                ) from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise PermissionDenied(
                    f"shared memory segment {name!r} is not a regular file owned by uid {os.geteuid()}"
                )
            if st.st_nlink != 1:
                # A second name for the file: one group's segment linked under another group's
                # name (where fs.protected_hardlinks=0 lets others link the daemon's files).
                raise PermissionDenied(f"shared memory segment {name!r} has {st.st_nlink} names; refusing it")
            size = st.st_size
            if size <= 0:
                raise InvalidArgument(f"shared memory segment {name!r} is empty")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = map_file(fd, size, prot=prot)
        finally:
            os.close(fd)
        segment = cls(name, mm, size, writable=writable)
        if prefault:
            segment.prefault()
        return segment

    def prefault(self) -> None:
        """Fault the whole mapping in now (contents are kept)."""
        if self._mmap is None:
            raise InvalidArgument(f"shared memory segment {self.name!r} is closed")
        _prefault(self._mmap, self.size, write=self.writable)

    @property
    def closed(self) -> bool:
        return self._buf is None

    @property
    def buf(self) -> memoryview:
        """Zero-copy view of the whole segment (read-only if opened read-only)."""
        if self._buf is None:
            raise InvalidArgument(f"shared memory segment {self.name!r} is closed")
        return self._buf

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        """A zero-copy tensor over ``[offset, offset + prod(shape) * itemsize)``.

        On a read-only segment the tensor must only be read (writes fault).
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = math.prod(shape)
        if any(d < 0 for d in shape):
            raise InvalidArgument(f"negative dimension in tensor shape {shape}")
        if offset < 0 or offset % itemsize:
            raise InvalidArgument(f"tensor offset {offset} is negative or not a multiple of {itemsize}")
        nbytes = count * itemsize
        if offset + nbytes > self.size:
            raise InvalidArgument(
                f"tensor of shape {shape} and dtype {dtype} at offset {offset} needs "
                f"{offset + nbytes} bytes; segment {self.name!r} has {self.size}"
            )
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        # numpy holds a real buffer export for as long as the array lives, which
        # is what keeps the mapping alive after close(); torch.frombuffer does not.
        raw = np.frombuffer(self.buf, dtype=np.uint8, count=nbytes, offset=offset)
        with warnings.catch_warnings():
            # torch warns on read-only arrays; the docstring states the contract.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(raw)
        return flat.view(dtype).view(shape)

    def close(self) -> None:
        """Drop this object's mapping. Idempotent. Views still alive keep it mapped."""
        if self._buf is None:
            return
        buf, self._buf = self._buf, None
        # Tensors made by tensor() may still export it; they keep the mapping alive.
        with contextlib.suppress(BufferError):
            buf.release()
        mm, self._mmap = self._mmap, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # Someone still holds a view; mmap unmaps when the last one dies.
                logger.debug("segment %s: views still alive, unmapping deferred", self.name)

    def unlink(self) -> None:
        """Remove the name from ``/dev/shm``. Idempotent. Existing mappings stay valid."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_path_for(self.name))

    @staticmethod
    def exists(name: str) -> bool:
        return os.path.exists(_path_for(name))

    def __enter__(self) -> SharedSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("rw" if self.writable else "ro")
        return f"SharedSegment({self.name!r}, size={self.size}, {state})"
