"""``pagedkv router``: an OpenAI-compatible proxy over several engines that publish KV events.

Each ``--engine`` is an engine's base URL; the router reads its ``GET /kv_events`` to find the
event stream and the hashing parameters, subscribes, and keeps a block-hash index of every
engine's cache. ``--policy cache-aware`` (SGLang's thresholds, each a flag) sends a request to
the engine holding its longest prefix unless the load is imbalanced; ``least-load`` and
``round-robin`` ignore the cache. ``--engine-state-file PATH`` keeps the engine list (with the
engines added and removed at run time by ``POST``/``DELETE /router/engines``) across restarts.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pagedkv.config import env_str
from pagedkv.errors import InvalidRequestError, PagedKVError, StateFileError
from pagedkv.route.policy import POLICY_NAMES, CacheAwareConfig
from pagedkv.router.state_file import EngineStateFile, parse_engine_url

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    defaults = CacheAwareConfig()
    p = argparse.ArgumentParser(prog="pagedkv router", description=__doc__)
    p.add_argument(
        "--engine", action="append", default=[], metavar="URL",
        help="an engine's base URL (http://HOST:PORT); repeat for each engine (needed unless "
        "--engine-state-file names a saved list)",
    )  # fmt: skip
    p.add_argument(
        "--engine-state-file", default=None, metavar="PATH",
        help="keep the engine list here (JSON, replaced atomically on every POST/DELETE "
        "/router/engines); at start a saved list replaces --engine, which seeds a new file",
    )  # fmt: skip
    p.add_argument(
        "--engine-state-on-error", default="refuse", choices=("refuse", "ignore"),
        help="a state file that cannot be read or parsed: refuse to start (default), or start "
        "from --engine with a warning on stderr (the file is replaced at the next change)",
    )  # fmt: skip
    p.add_argument(
        "--prefill", action="append", default=[], metavar="URL",
        help="a prefill engine (pagedkv serve --role prefill --redis URL); with these, each "
        "request is prefilled there first and --engine names the decode engines",
    )  # fmt: skip
    p.add_argument("--policy", default="cache-aware", choices=POLICY_NAMES)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument(
        "--model", default=None, metavar="DIR",
        help="the engines' model folder, for its tokenizer (text prompts route by cache only "
        "with it; token-id prompts need none)",
    )  # fmt: skip
    p.add_argument("--api-key", default=None, help="require this Bearer token (or PAGEDKV_API_KEY)")
    p.add_argument(
        "--engine-api-key", default=None,
        help="Bearer token sent to the engines (default: forward the client's header when the "
        "router has no --api-key of its own)",
    )  # fmt: skip
    p.add_argument(
        "--cache-threshold", type=float, default=defaults.cache_threshold,
        help="route by cache when the best prefix covers more than this share of the prompt",
    )  # fmt: skip
    p.add_argument(
        "--balance-abs-threshold", type=int, default=defaults.balance_abs_threshold,
        help="load is imbalanced when max - min exceeds this ...",
    )  # fmt: skip
    p.add_argument(
        "--balance-rel-threshold", type=float, default=defaults.balance_rel_threshold,
        help="... and max exceeds min times this (then: the least loaded engine)",
    )  # fmt: skip
    p.add_argument("--poll-interval", type=float, default=0.5, help="health/load poll seconds")
    p.add_argument(
        "--engine-discovery-interval", type=float, default=None, metavar="SECONDS",
        help="re-probe an engine that is down (or not up yet) every SECONDS (default: the "
        "poll interval); engines also join at run time by POST /router/engines",
    )  # fmt: skip
    p.add_argument("--log-level", default="info")
    return p


def resolve_engines(engines: list[str], state: EngineStateFile | None, on_error: str) -> list[str]:
    """The engines to start with: the saved list if there is one, else ``engines``.

    Raises StateFileError for a bad file unless ``on_error == "ignore"`` (then a warning on
    stderr, ``engines``, and the file left as it is until the next change). A missing file is
    written from ``engines`` now, so that a path that cannot be written fails at start rather
    than at the first change."""
    if state is None:
        return engines
    try:
        engines = [parse_engine_url(u) for u in engines]
    except ValueError as exc:  # a URL saved now must load at the next start
        raise InvalidRequestError(f"--engine: {exc}") from None
    try:
        saved = state.load()
    except StateFileError as exc:
        if on_error != "ignore":
            raise
        print(
            f"pagedkv router: warning: {exc}; starting from --engine (the file is replaced at "
            "the next POST/DELETE /router/engines)",
            file=sys.stderr,
        )
        return engines
    if saved is None:
        state.save(engines)
        return engines
    ignored = [u for u in engines if u.rstrip("/") not in saved]
    if ignored:
        logger.warning(
            "engines %s are not in %s (removed at run time?); POST /router/engines adds them",
            ignored,
            state.path,
        )
    return saved


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    import uvicorn

    from pagedkv.router.app import build_router_app
    from pagedkv.router.engines import EngineRegistry
    from pagedkv.router.prompts import PromptTokenizer

    logging.basicConfig(level=args.log_level.upper())
    if args.poll_interval <= 0:
        raise SystemExit(f"pagedkv router: --poll-interval must be > 0, got {args.poll_interval}")
    discovery = args.engine_discovery_interval
    if discovery is not None and discovery <= 0:
        raise SystemExit(
            f"pagedkv router: --engine-discovery-interval must be > 0, got {discovery}"
        )
    try:
        thresholds = CacheAwareConfig(
            args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold
        )
        tokenizer = None if args.model is None else PromptTokenizer(args.model)
        state = None
        if args.engine_state_file is not None:
            state = EngineStateFile(args.engine_state_file)
        engines = resolve_engines(args.engine, state, args.engine_state_on_error)
    except PagedKVError as exc:
        raise SystemExit(f"pagedkv router: {exc}") from None
    if not engines:
        parser.error("give at least one --engine URL (or an --engine-state-file that lists some)")
    headers = (
        {} if args.engine_api_key is None else {"authorization": f"Bearer {args.engine_api_key}"}
    )
    registry = EngineRegistry(
        engines,
        headers=headers,
        poll_interval_s=args.poll_interval,
        discovery_interval_s=discovery,
        state=state,
    )
    registry.poll_once()  # engines already up are routable from the first request
    prefill = None
    if args.prefill:
        prefill = EngineRegistry(
            args.prefill,
            headers=headers,
            poll_interval_s=args.poll_interval,
            discovery_interval_s=discovery,
        )
        prefill.poll_once()
    app = build_router_app(
        registry,
        policy=args.policy,
        cache_aware=thresholds,
        tokenizer=tokenizer,
        api_key=args.api_key or env_str("PAGEDKV_API_KEY"),
        engine_api_key=args.engine_api_key,
        prefill=prefill,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
