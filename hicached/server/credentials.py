"""Credentials (TCP tokens and TLS, the L3 secret), read and validated before anything else starts.

Every file is checked in Python first: grpc aborts the whole process (a C++
abort, exit -6) on an unreadable or garbage PEM, so a bad file must stop
startup here, as a ``ConfigError`` naming its key (the CLI exits 2 with that
one line). Immutable once loaded; safe to share between threads.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from hicached.config import ConfigError, L3Config, ServerConfig
from hicached.l3.framing import KEY_MIN_BYTES, L3Key

__all__ = ["TcpCredentials", "load", "load_l3_key"]


@dataclass(frozen=True)
class TcpCredentials:
    """Worker and admin bearer tokens and the TLS material (PEM bytes) of the TCP listener."""

    worker_token: str | None = None
    admin_token: str | None = None
    tls_key: bytes | None = None
    tls_cert: bytes | None = None
    tls_client_ca: bytes | None = None


def _read(key: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{key} = {path!r}: cannot read it: {exc.strerror}") from None


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
