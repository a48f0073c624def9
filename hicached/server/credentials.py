"""Credentials (TCP tokens and TLS, the L3 secret), read and validated before anything else starts.

Every file is checked in Python first: grpc aborts the whole process (a C++
abort, exit -6) on an unreadable or garbage PEM, so a bad file must stop
startup here, as a ``ConfigError`` naming its key (the CLI exits 2 with that
one line). Immutable once loaded; safe to share between threads.
"""

from __future__ import annotations

import logging
import os
import ssl
import stat
from dataclasses import dataclass

from hicached_client.pathwalk import walk

from hicached.config import ConfigError, L3Config, ServerConfig
from hicached.l3.framing import KEY_MIN_BYTES, L3Key
from hicached.paths import foreign_in

__all__ = ["TcpCredentials", "load", "load_l3_key", "warn_readable"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TcpCredentials:
    """Worker and admin bearer tokens and the TLS material (PEM bytes) of the TCP listener."""

    worker_token: str | None = None
    admin_token: str | None = None
    tls_key: bytes | None = None
    tls_cert: bytes | None = None
    tls_client_ca: bytes | None = None


# Larger than any token, key or PEM bundle a daemon needs.
MAX_CREDENTIAL_BYTES = 1 << 20


def _read(key: str, path: str) -> bytes:
    """The file's bytes. ConfigError naming ``key`` for a file that someone else could replace
    (:func:`_check_where`, judged before it is opened, and the file opened checked to be the
    one judged), that cannot be read, is not a regular file (opened without blocking: a FIFO
    hung the start), is over MAX_CREDENTIAL_BYTES, that its group or others can write (they
    would choose the token or key: the admin token gives every admin call; workers may share
    the daemon's group), or that a uid other than root and the daemon's owns."""
    judged = _check_where(key, path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            data = f.read(MAX_CREDENTIAL_BYTES + 1) if stat.S_ISREG(st.st_mode) else b""
    except OSError as exc:
        raise ConfigError(f"{key} = {path!r}: cannot read it: {exc.strerror}") from None
    if (st.st_dev, st.st_ino) != judged:
        raise ConfigError(f"{key} = {path!r}: the file changed while it was checked; try again")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{key} = {path!r}: not a regular file")
    if len(data) > MAX_CREDENTIAL_BYTES:
        raise ConfigError(f"{key} = {path!r}: larger than {MAX_CREDENTIAL_BYTES} bytes")
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_IWOTH | stat.S_IWGRP):
        who = "others" if mode & stat.S_IWOTH else "its group"
        raise ConfigError(
            f"{key} = {path!r}: the file is writable by {who} (mode {mode:04o}): they could choose "
            "its contents; chmod go-w (0400 or 0440 is enough)"
        )
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        # Its owner may chmod it and write a token of its choice whatever its mode is now.
        raise ConfigError(
            f"{key} = {path!r}: the file is owned by uid {st.st_uid}, who could choose its contents; "
            f"chown it to root or uid {me}"
        )
    return data


def _check_where(key: str, path: str) -> tuple[int, int]:
    """The ``(st_dev, st_ino)`` of the file ``path`` resolves to; ConfigError naming ``key``
    when it does not exist or a uid other than root and the daemon's could put another file
    there: it owns a directory or symlink the way to the file passes through (the kernel's way,
    symlinks met half-way and ``..`` included: :func:`hicached.paths.foreign_on_path`, as for
    the socket and journal directories), or one of those directories is writable by its group
    or others without the sticky bit (they could swap what it holds, between this check and
    the read too). Sticky directories (``/tmp``, a Kubernetes Secret volume's 1777 mount) are
    accepted: there only an entry's owner, checked here, can rename or remove it."""
    me = os.geteuid()
    try:
        way = walk(path)  # one walk, judged for everything: two could see two layouts
    except OSError as exc:  # a loop, a file on the way, a directory this uid cannot search
        raise ConfigError(f"{key} = {path!r}: cannot check its path: {exc.strerror}") from None
    if way.final is None:
        raise ConfigError(f"{key} = {path!r}: cannot read it: {way.missing} does not exist")
    found = foreign_in(way, (me, 0), itself=False)
    if found is not None:
        raise ConfigError(
            f"{key} = {path!r}: {found.path} on its path is {found.kind} owned by uid {found.uid}, "
            f"who could replace the file; use a path owned by root or uid {me}"
        )
    for step in way.steps:
        mode = step.st.st_mode
        if step.directory and mode & (stat.S_IWOTH | stat.S_IWGRP) and not mode & stat.S_ISVTX:
            who = "others" if mode & stat.S_IWOTH else "its group"
            raise ConfigError(
                f"{key} = {path!r}: {step.path} on its path is writable by {who} (mode "
                f"{stat.S_IMODE(mode):04o}) without the sticky bit: they could replace the file; "
                "chmod go-w the directory or move the file"
            )
    return way.final.st.st_dev, way.final.st.st_ino


def _warn_if_readable(key: str, path: str) -> None:
    """Log a warning when others can read the secret at ``path`` (after it was found valid):
    any local user could then call over TCP, as admin with the admin token."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return  # read a moment ago; nothing to warn about now
    if mode & stat.S_IROTH:
        logger.warning(
            "%s = %r is readable by others (mode %04o): any local user can read the secret; "
            "chmod o-r (0400, or 0440 for the daemon's group)",
            key,
            path,
            mode,
        )


def warn_readable(server: ServerConfig, l3: L3Config) -> None:
    """:func:`_warn_if_readable` for every secret file configured; called once :func:`load` and
    :func:`load_l3_key` found them valid (a refused start stays one line)."""
    for key, path in (
        ("server.auth_token_file", server.auth_token_file),
        ("server.admin_token_file", server.admin_token_file),
        ("server.tls_key", server.tls_key if server.tls_cert else ""),
        ("l3.auth_key_file", l3.auth_key_file),
    ):
        if path:
            _warn_if_readable(key, path)


def _token(key: str, path: str) -> str | None:
    if not path:
        return None
    try:
        token = _read(key, path).decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{key} = {path!r}: the token is not UTF-8 text") from None
    if not token:
        raise ConfigError(f"{key} = {path!r}: the file is empty (a token must not be empty)")
    if any(c.isspace() or not c.isprintable() for c in token):
        raise ConfigError(f"{key} = {path!r}: the token must be one line without spaces")
    return token


def _check_pems(cfg: ServerConfig) -> None:
    """Parse the PEMs with OpenSSL through the ssl module; name the key of the first bad one."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for key, path in (("server.tls_cert", cfg.tls_cert), ("server.tls_client_ca", cfg.tls_client_ca)):
        if not path:
            continue
        try:
            ctx.load_verify_locations(cafile=path)
        except (ssl.SSLError, ValueError):
            raise ConfigError(f"{key} = {path!r}: not a valid PEM certificate") from None
    try:
        ctx.load_cert_chain(certfile=cfg.tls_cert, keyfile=cfg.tls_key)
    except (ssl.SSLError, ValueError):
        raise ConfigError(
            f"server.tls_key = {cfg.tls_key!r}: not a valid PEM private key of server.tls_cert"
        ) from None


def load(cfg: ServerConfig) -> TcpCredentials:
    """Read every credential file the configuration names; ConfigError naming the bad key."""
    worker = _token("server.auth_token_file", cfg.auth_token_file)
    admin = _token("server.admin_token_file", cfg.admin_token_file)
    if admin is not None and admin == worker:
        raise ConfigError(
            "server.admin_token_file holds the same token as server.auth_token_file: "
            "the admin token must differ from the worker token"
        )
    if not cfg.tls_cert:
        return TcpCredentials(worker_token=worker, admin_token=admin)
    files = {
        "server.tls_key": cfg.tls_key,
        "server.tls_cert": cfg.tls_cert,
        "server.tls_client_ca": cfg.tls_client_ca,
    }
    data = {key: _read(key, path) if path else None for key, path in files.items()}
    _check_pems(cfg)
    return TcpCredentials(
        worker_token=worker,
        admin_token=admin,
        tls_key=data["server.tls_key"],
        tls_cert=data["server.tls_cert"],
        tls_client_ca=data["server.tls_client_ca"],
    )


def load_l3_key(cfg: L3Config) -> L3Key | None:
    """The keys derived from ``l3.auth_key_file`` (None when it is empty); ConfigError naming
    the key for a file that cannot be read or holds under ``KEY_MIN_BYTES`` bytes.

    The file's bytes are the secret, less trailing CR/LF: a secret written by ``echo`` and
    one written by ``printf`` then match on the daemons that share an L3 (a mismatch makes
    every page a miss)."""
    key, path = "l3.auth_key_file", cfg.auth_key_file
    if not path:
        return None
    secret = _read(key, path).rstrip(b"\r\n")
    if not secret:
        raise ConfigError(
            f"{key} = {path!r}: the file is empty (the secret must be at least {KEY_MIN_BYTES} bytes)"
        )
    if len(secret) < KEY_MIN_BYTES:
        raise ConfigError(
            f"{key} = {path!r}: the secret is {len(secret)} bytes, it must be at least {KEY_MIN_BYTES} "
            "(e.g. openssl rand -base64 48 > FILE)"
        )
    return L3Key.from_secret(secret)
