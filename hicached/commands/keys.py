"""``hicached keys``: print the L3 page keys of a token sequence, one hex key per line.

The keys are the ones a worker (SGLang HiCache storage) computes for the same
tokens, page size and namespace, so an operator can look a prefix up in L3.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hicached.commands._common import positive
from hicached.errors import InvalidArgument
from hicached.page_keys import page_keys


def parse_tokens(text: str) -> list[int]:
    tokens: list[int] = []
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            continue
        try:
            token = int(part, 10)
        except ValueError:
            raise InvalidArgument(f"token id {part[:32]!r} is not a decimal integer") from None
        if not 0 <= token < 2**64:
            raise InvalidArgument(f"token id {part[:32]} is outside [0, 2**64 - 1]")
        tokens.append(token)
    return tokens


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "keys",
        help="print the L3 page keys of a token sequence",
        description=(
            "Print the L3 page keys of a token sequence, one hex key per line: the chained SHA-256 "
            "keys SGLang's HiCache storage computes for the same tokens, page size and namespace "
            "(extra_key, cache_salt). Use them with `hicached lookup --keys` or to find a prefix in L3."
        ),
    )
    parser.add_argument("--page-size", type=positive, required=True, help="tokens per page")
    parser.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 1,2,3")
    parser.add_argument("--extra-key", default=None, help="request extra_key (namespaces the chain)")
    parser.add_argument("--cache-salt", default=None, help="request cache_salt (namespaces the chain)")
    parser.add_argument(
        "--full-pages-only", action="store_true", help="omit the key of a trailing partial page"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        keys = page_keys(
            parse_tokens(args.tokens),
            args.page_size,
            extra_key=args.extra_key,
            cache_salt=args.cache_salt,
            include_partial=not args.full_pages_only,
        )
    except InvalidArgument as exc:
        sys.stderr.write(f"hicached keys: {exc}\n")
        return 2
    sys.stdout.write("".join(f"{key}\n" for key in keys))
    return 0
