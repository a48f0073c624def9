"""Options of the ``s3`` L3 backend (:mod:`hicached.l3.s3`), checked when they are built."""

from __future__ import annotations

import dataclasses

from hicached.coerce import option, parse_size, typed_fields
from hicached.errors import InvalidArgument, clip

__all__ = ["MAX_OBJECT_BYTES", "MAX_OBJECT_KEY_BYTES", "S3BackendConfig"]

MAX_OBJECT_KEY_BYTES = 1024  # S3's limit on an object name
MAX_OBJECT_BYTES = 512 << 20  # as the redis backend's max_value_bytes
_ADDRESSING = ("auto", "path", "virtual")


@dataclasses.dataclass(frozen=True)
class S3BackendConfig:
    """Options of the ``s3`` backend.

    ``bucket``: bucket name (required). ``endpoint_url``: the S3 endpoint, e.g.
    ``http://127.0.0.1:8333`` for SeaweedFS/MinIO; empty uses AWS's endpoint
    for ``region``. ``prefix``: prepended to every object name (e.g.
    ``"hicached/prod/"``), so several deployments can share a bucket.
    ``access_key_id``/``secret_access_key``: both or neither; neither uses
    boto3's default credential chain (environment, ``~/.aws``, instance role).
    ``threads``: concurrent requests (and pooled connections) per call.
    ``create_bucket``: create the bucket at start when it is missing (else a
    missing bucket is a configuration error). ``conditional_put``: use
    ``If-None-Match: *`` to skip existing keys in one request (see :mod:`hicached.l3.s3`).
    ``addressing_style``: ``auto``, ``path`` or ``virtual``. Timeouts are per
    request; ``max_attempts`` counts the first attempt and boto3's retries.
    ``stats_ttl_s``: ``stats()`` lists the prefix (one request per 1000
    objects); its page/byte counts are reused for this many seconds (a HEAD
    of the bucket checks the store meanwhile). ``max_object_bytes``: the most of one object a
    ``get`` reads (a ``get_into`` reads at most its destination's frame); a
    larger object is a miss, and its body is not read past that bound even
    when the store sends no ``Content-Length``.
    """

    bucket: str = option(help="Bucket name.")
    endpoint_url: str = option("", help="S3 endpoint, e.g. http://127.0.0.1:8333 (empty = AWS for region).")
    region: str = option("us-east-1", help="Region.")
    prefix: str = option("", help="Prepended to every object name (deployments can share a bucket).")
    access_key_id: str = option("", help="Access key (with secret_access_key; empty = boto3's chain).")
    secret_access_key: str = option("", help="Secret key (with access_key_id).")
    threads: int = option(8, help="Concurrent requests (and pooled connections) per call.")
    create_bucket: bool = option(False, help="Create the bucket at start when it is missing.")
    conditional_put: bool = option(True, help="Skip existing keys with If-None-Match: * in one request.")
    addressing_style: str = option("auto", help="auto, path or virtual.")
    connect_timeout_s: float = option(5.0, help="Per-request connect timeout in seconds.")
    read_timeout_s: float = option(30.0, help="Per-request read timeout in seconds.")
    max_attempts: int = option(3, help="Attempts per request in all (the first and boto3's retries).")
    stats_ttl_s: float = option(30.0, help="Seconds a bucket listing's page/byte counts are reused.")
    max_object_bytes: int = option(
        MAX_OBJECT_BYTES,
        help="Most bytes of one object read for a page of unknown size (page + frame header); "
        "a larger object is a miss, never read whole.",
        parse=parse_size,
    )

    def target(self) -> str:
        """Where the pages are, for the startup line and errors."""
        return f"{self.endpoint_url or 'aws:' + self.region}/{self.bucket}/{self.prefix}"

    def __post_init__(self) -> None:
        typed_fields(self, "l3.s3")  # a config built in Python is checked as a file's
        if not self.bucket:
            raise InvalidArgument("s3 backend option 'bucket' must be a non-empty bucket name")
        if self.endpoint_url and not self.endpoint_url.startswith(("http://", "https://")):
            raise InvalidArgument(
                f"s3 backend option 'endpoint_url' must start with http:// or https://, "
                f"got {clip(self.endpoint_url)}"
            )
        if self.prefix.startswith("/") or len(self.prefix.encode("utf-8")) >= MAX_OBJECT_KEY_BYTES:
            raise InvalidArgument(
                f"s3 backend option 'prefix' must not start with '/' and must be shorter than "
                f"{MAX_OBJECT_KEY_BYTES} bytes, got {clip(self.prefix)}"
            )
        if bool(self.access_key_id) != bool(self.secret_access_key):
            raise InvalidArgument(
                "s3 backend options 'access_key_id' and 'secret_access_key' must be given together"
            )
        if not 1 <= self.threads <= 256:
            raise InvalidArgument(f"s3 backend option 'threads' must be in 1..256, got {clip(self.threads)}")
        if self.addressing_style not in _ADDRESSING:
            raise InvalidArgument(
                f"s3 backend option 'addressing_style' must be one of {', '.join(_ADDRESSING)}, "
                f"got {clip(self.addressing_style)}"
            )
        for opt in ("connect_timeout_s", "read_timeout_s"):
            if not getattr(self, opt) > 0:
                raise InvalidArgument(f"s3 backend opt {opt!r} must be > 0, got {clip(getattr(self, opt))}")
        if self.max_attempts < 1:
            raise InvalidArgument(
                f"s3 backend opt 'max_attempts' must be >= 1, got {clip(self.max_attempts)}"
            )
        if self.max_object_bytes < 1:
            raise InvalidArgument(
                f"s3 backend opt 'max_object_bytes' must be >= 1, got {clip(self.max_object_bytes)}"
            )
        if self.stats_ttl_s < 0:
            raise InvalidArgument(f"s3 backend opt 'stats_ttl_s' must be >= 0, got {clip(self.stats_ttl_s)}")
