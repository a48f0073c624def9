"""``hicached lookup``: which tiers of a running daemon hold a prefix (L2 host memory, L3).

The Lookup RPC answers for one pool group, and a group is named by what its workers
share: the model, the TP/PP position and the exact pool layout. So this command takes
the worker's pool layout and attaches a byte-only session to that group with
``join_only`` (no shared memory, nothing allocated: the daemon joins an existing group
or answers NOT_FOUND), asks Lookup and detaches; it never creates a group. GetStats is
not asked first: a worker sees no pool groups but its own session's. Groups of more
than one pool (sidecars, draft pools) are out of reach of its flags.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from hicached_client import HiCacheClient, HiCacheError, TokenChain, WorkerIdentity, pool_spec, vocab

from hicached.commands._common import count, positive, shown
from hicached.commands._target import add_target_flags, client_of, failure_message, target_of
from hicached.commands.keys import parse_tokens
from hicached.errors import InvalidArgument

EXIT_MISS = 1
EXIT_USAGE = 2

DESCRIPTION = """\
Ask a running daemon which tiers hold a prefix: how many leading pages are in L2 (host
memory) and how many in L2 or L3, for the pool group of the worker layout you give.

Give the layout the worker attached with (--model, --page-size, --layers, --heads,
--head-dim, --dtype, ...) and the prefix as token ids (--tokens, with the request's
--extra-key/--cache-salt) or as page keys (--keys, e.g. from `hicached keys`). The command
attaches a byte-only session to that group, asks, and detaches; it never creates a group.
Exit 0 when every page is cached somewhere, 1 when some are not (or the group is unknown),
2 for bad arguments.
"""


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "lookup",
        help="which tiers (L2, L3) of a running daemon hold a prefix",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_flags(parser)
    layout = parser.add_argument_group("the worker's pool group (as it attached)")
    layout.add_argument("--model", required=True, help="model_name of the worker identity")
    layout.add_argument("--page-size", type=positive, required=True, help="tokens per page")
    layout.add_argument("--layers", type=positive, required=True, help="num_layers of the pool")
    layout.add_argument("--heads", type=positive, required=True, help="KV heads per rank (1 for MLA)")
    layout.add_argument("--head-dim", type=positive, required=True, help="head dim (MLA: latent dim)")
    layout.add_argument("--dtype", default="bfloat16", help="KV dtype (default: %(default)s)")
    layout.add_argument(
        "--kind", default="mha", choices=("mha", "mla"), help="pool kind (default: %(default)s)"
    )
    layout.add_argument("--pool", default="kv", help="pool name (default: %(default)s)")
    layout.add_argument(
        "--host-layout", default="layer_first", help="host layout of the pool (default: %(default)s)"
    )
    for name in ("tp-rank", "tp-size", "pp-rank", "pp-size"):
        size = name.endswith("size")
        layout.add_argument(f"--{name}", type=positive if size else count, default=1 if size else 0)
    prefix = parser.add_argument_group("the prefix (one of)")
    which = prefix.add_mutually_exclusive_group(required=True)
    which.add_argument("--tokens", help="comma-separated token ids, e.g. 1,2,3")
    which.add_argument("--keys", help="comma-separated hex page keys in prefix order")
    prefix.add_argument("--extra-key", default=None, help="request extra_key (with --tokens)")
    prefix.add_argument("--cache-salt", default=None, help="request cache_salt (with --tokens)")
    prefix.add_argument("--tenant", default="", help="tenant label of the request")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def _specs(args: argparse.Namespace) -> tuple[WorkerIdentity, Any]:
    if args.kind == "mla" and args.heads != 1:  # the daemon would name its wire field, not the flag
        raise InvalidArgument(
            f"--heads must be 1 with --kind mla (an MLA pool has one latent head), got {args.heads}"
        )
    identity = WorkerIdentity(
        f"hicached-lookup-{os.getpid()}",
        generation=1,
        model_name=args.model,
        tp_rank=args.tp_rank,
        tp_size=args.tp_size,
        pp_rank=args.pp_rank,
        pp_size=args.pp_size,
        tenant=args.tenant,  # a session sees only its own tenant's pages
    )
    try:
        spec = pool_spec(
            args.pool,
            role="anchor",
            kind=args.kind,
            dtype=args.dtype,
            page_size=args.page_size,
            num_layers=args.layers,
            num_heads=args.heads,
            head_dim=args.head_dim,
            host_layout=args.host_layout,
            k_buffers=(),
            # One page: the daemon refuses a pool of no page, and joins only a group at least
            # this big (join_only: it never creates one). Four pages of 8-byte elements missed
            # every group of fewer than 16 bf16 pages ("no pool group for this layout").
            host_bytes=_page_bytes(args),
        )
    except (ValueError, KeyError, AttributeError, TypeError) as exc:
        raise InvalidArgument(str(exc)) from None
    return identity, spec


def _page_bytes(args: argparse.Namespace) -> int:
    """Bytes of one host page of the layout, as the daemon sizes its pools (``KVSpec.page_bytes``;
    tests/acceptance/test_cli.py holds the two equal), without importing torch (~1.5 s)."""
    try:
        itemsize = vocab.DATA_TYPE_BYTES[vocab.DataType(args.dtype.removeprefix("torch."))]
    except ValueError:
        raise ValueError(f"--dtype {args.dtype[:32]!r} is none of {', '.join(vocab.DataType)}") from None
    kv = 2 if vocab.PoolKind(args.kind) is vocab.PoolKind.MHA else 1  # argparse took one of them
    return int(kv * args.layers * args.heads * args.head_dim * args.page_size * itemsize)


def _no_group(client: HiCacheClient, model: str) -> None:
    """Say the daemon has no group for the layout; list the model's groups where the caller
    may see them (an admin; a worker's GetStats shows no groups)."""
    print(
        "hicached lookup: the daemon has no pool group for this layout (after a warm restart, a "
        "journaled group is mapped again only when a worker attaches with it).",
        file=sys.stderr,
    )
    groups = client.get_stats().groups
    if not groups:
        print("  (`hicached status` on the admin socket lists the groups it has)", file=sys.stderr)
        return
    same_model = [g for g in groups if g.model_name == model]
    for g in same_model:  # the daemon's strings: shown() escapes what a terminal would obey
        pools = ", ".join(
            f"{shown(p.name)} (page_size {p.page_size}, {p.page_bytes} B/page)" for p in g.pools
        )
        print(f"  group {shown(g.group)} of model {g.model_name!r}: {pools}", file=sys.stderr)
    if not same_model:
        print(f"  no group of model {model!r}; groups: {len(groups)}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    target = target_of(args)
    try:
        if args.keys is not None:
            if args.extra_key is not None or args.cache_salt is not None:
                raise InvalidArgument("--extra-key/--cache-salt go with --tokens (keys already include them)")
            keys: Any = [k.strip() for k in args.keys.split(",") if k.strip()]
        else:
            tokens = parse_tokens(args.tokens)
            if 0 < len(tokens) < args.page_size:
                # A cache holds whole pages only: nothing to ask (it answered "0 pages asked").
                raise InvalidArgument(
                    f"{len(tokens)} token ids make no full page of --page-size {args.page_size}"
                )
            keys = TokenChain(tokens, extra_key=args.extra_key, cache_salt=args.cache_salt)
        if not (keys.token_ids if isinstance(keys, TokenChain) else keys):
            raise InvalidArgument("no token ids or keys given (--tokens 1,2,3 or --keys K1,K2)")
        identity, spec = _specs(args)
    except InvalidArgument as exc:
        print(f"hicached lookup: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with client_of(args, target) as client:
            try:
                session = client.attach(identity, [spec], heartbeat=False, join_only=True)
            except HiCacheError as exc:
                if exc.code.name != "NOT_FOUND":
                    raise
                _no_group(client, args.model)
                return EXIT_MISS
            gid = session.info.group
            try:
                result = session.lookup(keys)
            finally:
                session.detach()
    except HiCacheError as exc:
        print(failure_message(target, exc.code, exc.message), file=sys.stderr)
        return EXIT_USAGE if exc.code.name == "INVALID_ARGUMENT" else EXIT_MISS
    n, l2, total = len(result.keys), result.l2_hit_pages, result.total_hit_pages
    tiers = ["L2" if i < l2 else "L3" if i < total else "-" for i in range(n)]
    if args.json:
        print(
            json.dumps(
                {
                    "group": gid,
                    "pages": n,
                    "l2_hit_pages": l2,
                    "total_hit_pages": total,
                    "keys": list(result.keys),
                    "tiers": tiers,
                }
            )
        )
    else:
        print(f"group {shown(gid)} (model {args.model!r}): {n} pages asked")
        print(f"  leading pages in L2 (host memory): {l2}")
        print(f"  leading pages in L2 or L3:         {total}")
        for i, (key, tier) in enumerate(zip(result.keys, tiers, strict=True)):
            print(f"  {i:6}  {shown(key)}  {tier}")
    return 0 if total == n else EXIT_MISS
