"""``strata serve``'s security, limits, lifecycle and CORS flags, and the ServeOptions fields they set."""
from __future__ import annotations

import argparse

from strataserve.cli_types import check_tls_pair, positive_int, positive_mib, seconds, str_list


def add_door_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security, limits, lifecycle")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS and gRPC over TLS with this certificate (PEM)")
    g.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
    g.add_argument("--metrics-require-key", action="store_true", help="/metrics needs the API key too")
    g.add_argument("--requests-per-minute", type=positive_int, default=None, help="per API key; beyond: 429")
    g.add_argument("--tokens-per-minute", type=positive_int, default=None,
                   help="per API key, counting prompt + n x max_tokens at admission; beyond: 429")
    g.add_argument("--limit-n", type=positive_int, default=None,
                   help="largest n of one request (at most the protocol's 128, the limit when unset)")
    g.add_argument("--limit-max-tokens", type=positive_int, default=None,
                   help="largest max_tokens of a request (unset: the context)")
    g.add_argument("--limit-prompt-tokens", type=positive_int, default=None,
                   help="longest prompt, in tokens (unset: the context)")
    g.add_argument("--limit-stop", type=positive_int, default=None, help="most stop strings per request (unset: 16)")
    g.add_argument("--limit-logit-bias", type=positive_int, default=None, help="most logit_bias entries (unset: 300)")
    g.add_argument("--max-queued-mib", type=positive_mib, default=1024.0,
                   help="total size of the request bodies in flight; beyond it new requests get 503")
    g.add_argument("--grpc-max-message-mib", type=positive_mib, default=None,
                   help="largest gRPC message (unset: --max-request-body-mib)")
    g.add_argument("--shutdown-timeout", type=seconds, default=10.0,
                   help="on SIGTERM, seconds to let in-flight requests finish (new ones get 503) before stopping")
    g.add_argument("--engine-restart", action=argparse.BooleanOptionalAction, default=True,
                   help="restart a crashed engine process (with back-off on a crash loop)")
    c = p.add_argument_group("CORS (vLLM's flags; off unless --allowed-origins is given, unlike vLLM's '*')")
    c.add_argument("--allowed-origins", type=str_list, default=None, metavar="LIST",
                   help="origins a browser page may call from: a JSON list or commas ('*' = any)")
    c.add_argument("--allowed-methods", type=str_list, default=["*"], metavar="LIST", help="CORS methods")
    c.add_argument("--allowed-headers", type=str_list, default=["*"], metavar="LIST", help="CORS request headers")
    c.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies / HTTP auth")


def door_options(args: argparse.Namespace) -> dict:
    """ServeOptions fields of the security / limits / lifecycle flags (ValueError names a bad value)."""
    from strataserve.api.door import CORS
    from strataserve.api.limits import RequestLimits
    from strataserve.router.quota import RateLimits

    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        raise ValueError("give both --ssl-certfile and --ssl-keyfile, or neither")
    if args.ssl_certfile is not None:
        check_tls_pair(args.ssl_certfile, args.ssl_keyfile)
    limits = {k: v for k, v in (("max_n", args.limit_n), ("max_tokens", args.limit_max_tokens),
                                ("max_prompt_tokens", args.limit_prompt_tokens), ("max_stop", args.limit_stop),
                                ("max_logit_bias", args.limit_logit_bias)) if v is not None}
    grpc_mib = args.grpc_max_message_mib
    return dict(ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                metrics_require_key=args.metrics_require_key,
                rate=RateLimits(args.requests_per_minute, args.tokens_per_minute), limits=RequestLimits(**limits),
                max_queued_bytes=int(args.max_queued_mib * 2**20),
                grpc_max_message_bytes=int(grpc_mib * 2**20) if grpc_mib else None,
                graceful_shutdown_s=args.shutdown_timeout, restart_engines=args.engine_restart,
                cors=CORS(tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                          args.allow_credentials) if args.allowed_origins else None)
