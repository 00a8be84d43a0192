"""`python -m k3jax.serve`: the OpenAI-compatible server.

With no arguments it serves the embedded (trained) tiny model on 127.0.0.1:8000. `--model PATH` serves a
converted or Hugging Face checkpoint directory (or a preset name with --seed for random weights).

Multi-host: start the same command on every process with --coordinator/--num-processes/--process-id
(or the K3JAX_* variables the launch scripts set). Process 0 serves HTTP and schedules; the others
load the model and follow process 0's steps (serving/multihost.py), exiting when it shuts down.
A process that fails or goes silent ends every process within seconds, process 0 naming it and
its stage (serving/multihost_watch.py).
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import time

from k3jax.cli_help import DefaultsHelpFormatter, add_model_source_args, int_at_least
from serving.engine_args import add_advanced_args, advanced_kwargs, claim_device_memory
from serving.engine_args import field_default as D        # the engine's defaults are the flags' defaults

# (the same numbers as serving.openai.http_guard, which the --help text must not import: no uvicorn needed)
FD_HEADROOM, HEALTH_RESERVE = 512, 16

log = logging.getLogger("k3jax.serve")


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _seconds_or_off(text: str) -> float:
    """A positive number of seconds, or 0 (off)."""
    try:
        if float(text) == 0:
            return 0.0
    except ValueError:
        pass
    return _seconds(text)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m k3jax.serve", description=__doc__.splitlines()[0],
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--model", default="tiny", help="preset name (tiny, tiny-random, kimi-linear-48b-a3b, kimi-k3) checkpoint directory or Hugging Face model id (ORG/NAME)")
    add_model_source_args(ap)
    ap.add_argument("--served-model-name", default=None,
                    help="model name clients send and /v1/models lists (default: the --model name)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    ap.add_argument("--port", type=int_at_least(0, 65535), default=8000, help="TCP port")
    ap.add_argument("--api-key", default=os.environ.get("K3JAX_API_KEY"), help="require 'Authorization: Bearer KEY' (default: $K3JAX_API_KEY, else no key)")
    ap.add_argument("--dtype", default=None, help="weight and cache dtype, e.g. bfloat16 or float32 (default: the checkpoint's)")
    ap.add_argument("--mesh", default=None, help='device mesh, e.g. "data=2,expert=4" (default: one device)')
    ap.add_argument("--seed", type=int, default=None, help="random weights from this seed, for a preset without weights (default: none)")
    ap.add_argument("--max-num-seqs", type=int_at_least(1), default=None,
                    help="most sequences in one step (the batch) (default: 16 on CPU, 64 on a GPU/TPU)")
    ap.add_argument("--max-num-batched-tokens", type=int_at_least(1), default=None,
                    help="most tokens in one step (prefill chunks + decodes) (default: 512 on CPU, 4096 on a GPU/TPU)")
    ap.add_argument("--max-model-len", type=int_at_least(2), default=None,
                    help="context length, prompt + output (default: the model's window when the cache holds one "
                         "sequence that long, else the longest it holds; on CPU at most 8192; logged at start-up)")
    ap.add_argument("--page-size", type=int_at_least(1), default=D("page_size"), help="tokens per MLA cache page")
    ap.add_argument("--prefix-match-unit", type=int_at_least(1), default=D("prefix_match_unit"),
                    help="prefix-cache granularity in tokens (divides --page-size)")
    ap.add_argument("--state-block-size", type=int_at_least(0), default=D("state_block_size"),
                    help="KDA state checkpoints in long prompts on this grid: a prompt chunk reaching past a multiple "
                         "ends at the last one inside it and checkpoints there (0 = off)")
    ap.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    ap.add_argument("--prefix-wait-steps", type=int_at_least(0), default=D("prefix_wait_steps"),
                    help="a waiting request whose prompt prefix a running prefill is computing waits for its checkpoint "
                         "up to this many steps instead of computing it again (0 = admit at once)")
    ap.add_argument("--interactive-prefill-pairs", type=int_at_least(0), default=D("interactive_prefill_pairs"),
                    metavar="PAIRS", help="while decode rows run, a prefill chunk's (query, key) attention pairs at "
                                          "most, so a long prompt's steps stay short for the other streams (0 = no cap)")
    ap.add_argument("--long-prefill-tokens", type=int_at_least(0), default=None, metavar="TOKENS",
                    help="a lone long prompt's step (nothing else running or waiting) takes this many tokens "
                         "(default: 16384 on a GPU/TPU, off on CPU; <= --max-num-batched-tokens: off; dropped, logged, "
                         "when its activations would shorten --max-model-len, and on a mesh)")
    ap.add_argument("--verify-prefix-cache", type=float, default=D("verify_prefix_cache"), metavar="FRACTION",
                    help="recompute this fraction of prefix-cache hits from scratch in the background and compare the "
                         "first token's log-probabilities (k3jax:prefix_cache_verify_* counters, a warning on a mismatch)")
    ap.add_argument("--verify-prefix-cache-tolerance", type=float, default=D("verify_prefix_cache_tolerance"),
                    help="largest log-probability difference a verified hit may show")
    ap.add_argument("--host-cache-mb", type=int_at_least(0), default=0,
                    help="host-memory tier for prefix-cache checkpoints evicted from the device, in MiB (0 = off; "
                         "--role decode: at least 1024, entries from the prefill peer pass through it)")
    sp = ap.add_argument_group("speculative decoding")
    sp.add_argument("--speculative", choices=["off", "ngram", "draft"], default="off",
                    help="draft tokens verified by one target step: ngram (prompt lookup, no extra model) or draft "
                         "(--draft-model); greedy output is unchanged, sampled output keeps its distribution; "
                         "requests with structured output or penalties are not speculated (default: off)")
    sp.add_argument("--num-speculative-tokens", type=int_at_least(1), default=4, metavar="K",
                    help="most draft tokens per sequence and step (adaptive: fewer, or none, for a sequence whose "
                         "drafts are rejected)")
    sp.add_argument("--draft-model", default=None, metavar="PATH_OR_PRESET",
                    help="--speculative draft: a smaller model with the target's vocabulary")
    sp.add_argument("--speculative-max-batch", type=int_at_least(1), default=32,
                    help="no speculation in steps with more decoding sequences than this")
    sp.add_argument("--no-speculative-adaptive", action="store_true",
                    help="always propose K drafts (default: shrink or pause per sequence on low acceptance)")
    sp.add_argument("--speculative-on-gpu", action="store_true",
                    help="run speculation over GPU kernels anyway (refused by default: on the H200 its greedy tokens "
                         "differ from speculation off; docs/performance.md)")
    dg = ap.add_argument_group("prefill/decode disaggregation")
    dg.add_argument("--role", choices=["single", "prefill", "decode"], default="single",
                    help="prefill: compute prompts for decode servers (POST /internal/prefill) and offer their cache "
                         "entries; decode: serve clients, have --prefill-peer compute prompts, pull their entries")
    dg.add_argument("--prefill-peer", default=None, help="HOST:PORT of the prefill server (--role decode)")
    dg.add_argument("--prefill-timeout", type=float, default=30.0,
                    help="seconds for the peer's prefill and for the transfer; past them the request prefills locally")
    dg.add_argument("--transfer-address", default=None,
                    help="HOST:PORT of this process's jax.experimental.transfer server (default: --host, any port)")
    ap.add_argument("--memory-fraction", type=float, default=D("memory_fraction"),
                    help="the cache's share of the device memory left after the weights and the largest step's "
                         "activations")
    ap.add_argument("--cache-memory-mb", type=int_at_least(1), default=None, help="cache size in MiB (default: from --memory-fraction)")
    ap.add_argument("--max-waiting", type=int_at_least(1), default=D("max_waiting"), help="queue bound; beyond it requests get 429")
    ap.add_argument("--max-n", type=int_at_least(1), default=128, help="most choices (n) one request may ask for; above: 400")
    ap.add_argument("--max-prompts-per-request", type=int_at_least(1), default=256,
                    help="most prompts in one /v1/completions request; above: 400 (n x prompts must also fit "
                         "--max-waiting)")
    ap.add_argument("--max-body-mb", type=float, default=32.0,
                    help="largest request body in MiB (413 above; keep it over 4/3 of --max-image-mb for data URLs)")
    ap.add_argument("--stream-send-timeout", type=_seconds_or_off, default=60.0,
                    help="seconds a streamed response may wait on a client that reads nothing (its connection "
                         "accepts no more bytes) before the stream and its request are ended, like nginx's "
                         "send_timeout; 0 = wait for ever (the request then runs to max_tokens)")
    hg = ap.add_argument_group("slow and surplus clients")
    hg.add_argument("--header-timeout", type=_seconds_or_off, default=20.0,
                    help="seconds a client has to send a request's whole header block, from connecting (or, on a "
                         "kept-alive connection, from the request's first byte); past it: 408 and the connection "
                         "is closed. A deadline, so sending a byte at a time does not extend it; 0 = no limit")
    hg.add_argument("--body-timeout", type=_seconds_or_off, default=60.0,
                    help="seconds a client has to send a request's whole body, from the end of its headers; past "
                         "it: 408 and the connection is closed (32 MiB in 60 s needs ~0.55 MiB/s); 0 = no limit")
    hg.add_argument("--max-connections", type=int_at_least(0), default=None,
                    help="open connections past which a request gets a 503 and its connection is closed; "
                         f"{HEALTH_RESERVE} more are kept for /health and /metrics, and past those an idle or "
                         "slow-header connection is closed to make room (default: the process's soft "
                         f"file-descriptor limit less {FD_HEADROOM + HEALTH_RESERVE}; 0 = no cap)")
    ap.add_argument("--responses-store-size", type=int_at_least(0), default=1024,
                    help="Responses API: most responses kept for previous_response_id and GET /v1/responses/{id}, "
                         "least recently used dropped first (0 = none kept)")
    ap.add_argument("--responses-store-ttl", type=_seconds, default=3600.0,
                    help="Responses API: seconds a stored response is kept after its last use")
    ap.add_argument("--no-warmup", action="store_true", help="skip compiling every step shape at start (first requests compile)")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="wait for each step's tokens before scheduling the next (default: the next step is "
                         "scheduled while one runs on the device)")
    ap.add_argument("--decode-steps-per-launch", type=int_at_least(1), default=None, metavar="N",
                    help="decode steps run on the device per launch while at most --decode-steps-max-seqs sequences "
                         "decode and none needs the host between tokens (logprobs, penalties, structured output, "
                         "speculation and waiting requests take one step per launch); stop strings and EOS are "
                         "checked after the launch (default: 8 on an accelerator, 1 on CPU; 1 = off)")
    ap.add_argument("--decode-steps-max-seqs", type=int_at_least(1), default=D("decode_steps_max_seqs"),
                    help="most decoding sequences for several decode steps per launch")
    ap.add_argument("--compile-threads", type=int_at_least(1), default=None,
                    help="host threads compiling the warm-up's step shapes (default: half the cores, up to 8)")
    ap.add_argument("--forbid-compile-after-warmup", action="store_true", help="fail a step that would compile after warm-up")
    ap.add_argument("--shutdown-timeout", type=_seconds, default=30.0,
                    help="seconds in-flight requests may run after SIGTERM; then they end with an error event")
    ap.add_argument("--reasoning", choices=["auto", "on", "off"], default="auto",
                    help="does the model start its answer with reasoning? auto: the model's own default (K3 yes; Kimi Linear and the embedded tiny no)")
    ap.add_argument("--allow-remote-images", action="store_true",
                    help="fetch http(s) image URLs (off: data URLs, and files under --image-dir, only)")
    ap.add_argument("--image-dir", default=None, help="accept local image paths under this directory (default: none)")
    ap.add_argument("--max-image-mb", type=float, default=20.0, help="largest encoded image accepted, in MiB")
    ap.add_argument("--image-fetch-timeout", type=float, default=10.0, help="seconds for a remote image")
    ap.add_argument("--encoder-cache-mb", type=int_at_least(0), default=D("encoder_cache_bytes") >> 20,
                    help="vision encoder output cache in MiB")
    ap.add_argument("--no-vision", action="store_true",
                    help="serve a multimodal model as text only (no tower warm-up; image parts get a 400)")
    ap.add_argument("--compilation-cache-dir", default=None, help="persistent XLA cache (default: ~/.cache/k3jax/xla)")
    ap.add_argument("--executable-cache", action=argparse.BooleanOptionalAction, default=True,
                    help="keep warm-up's compiled step programs in the compilation cache directory, keyed on the "
                         "code, model, settings and devices, so a restart skips tracing and lowering them")
    ap.add_argument("--log-level", default="info", help="debug, info, warning or error")
    add_advanced_args(ap)
    mh = ap.add_argument_group("multi-host (default: K3JAX_COORDINATOR / K3JAX_NUM_PROCESSES / K3JAX_PROCESS_ID)")
    mh.add_argument("--coordinator", default=None, help="host:port of process 0 (jax.distributed)")
    mh.add_argument("--num-processes", type=int, default=None, help="processes in the run")
    mh.add_argument("--process-id", type=int, default=None, help="0 serves HTTP; others follow its steps")
    mh.add_argument("--heartbeat-timeout", type=_seconds, default=30.0,
                    help="seconds without a heartbeat after which a process counts as lost and every process exits "
                         "(a process that is loading or compiling keeps beating)")
    mh.add_argument("--startup-timeout", type=_seconds, default=7200.0,
                    help="seconds every process gets to load the checkpoint and warm up before the run is ended")
    mh.add_argument("--step-timeout", type=_seconds, default=900.0,
                    help="seconds one multi-host step may stay unfinished (a compile included) before the run is ended")
    return ap


def follow(args) -> int:
    """Processes 1..N-1: load the same model, then make process 0's jitted calls until it shuts down."""
    from k3jax.api import load_model
    from serving import follower, multihost_watch
    from serving.engine import enable_compilation_cache
    from serving.engine_args import EngineArgs
    try:
        multihost_watch.set_stage("load")
        model = load_model(args.model, dtype=args.dtype, seed=args.seed, mesh=args.mesh, revision=args.revision,
                           download_dir=args.download_dir, **EngineArgs(**advanced_kwargs(args)).load_options())
        enable_compilation_cache(args.compilation_cache_dir or EngineArgs().compilation_cache_dir)
        multihost_watch.set_stage("warmup")
    except Exception as e:  # noqa: BLE001 - every failure ends the run, named on process 0
        multihost_watch.current().fail(e)
    return follower.exit_follower(follower.follow(model))


def build_state(args, request_matcher=None):
    from k3jax.api import load_model
    from serving import multihost
    from serving.async_engine import AsyncEngine
    from serving.engine import LLMEngine
    from serving.engine_args import EngineArgs
    from serving.openai.generation import ServerState
    from serving.openai.metrics import Metrics
    from serving.multihost_watch import set_stage

    if args.role != "single" and multihost.is_multiprocess():
        raise ValueError(f"--role {args.role}: disaggregation runs single-process servers (no --coordinator)")
    if args.role == "decode" and not args.prefill_peer:
        raise ValueError("--role decode needs --prefill-peer HOST:PORT")
    if args.role != "single" and args.no_prefix_caching:
        raise ValueError(f"--role {args.role}: cache entries travel through the prefix cache; drop --no-prefix-caching")
    eargs = EngineArgs(          # first: a bad setting is refused before a model loads for minutes
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, page_size=args.page_size, prefix_match_unit=args.prefix_match_unit,
        state_block_size=args.state_block_size, enable_prefix_caching=not args.no_prefix_caching,
        prefix_wait_steps=args.prefix_wait_steps, verify_prefix_cache=args.verify_prefix_cache,
        interactive_prefill_pairs=args.interactive_prefill_pairs, long_prefill_tokens=args.long_prefill_tokens,
        verify_prefix_cache_tolerance=args.verify_prefix_cache_tolerance,
        host_cache_bytes=max(args.host_cache_mb, 1024 if args.role == "decode" else 0) << 20,
        memory_fraction=args.memory_fraction,
        cache_memory_bytes=args.cache_memory_mb << 20 if args.cache_memory_mb else None,
        max_waiting=args.max_waiting, warmup=not args.no_warmup, compile_threads=args.compile_threads,
        forbid_compile_after_warmup=args.forbid_compile_after_warmup,
        async_scheduling=not args.no_async_scheduling, decode_steps_per_launch=args.decode_steps_per_launch,
        decode_steps_max_seqs=args.decode_steps_max_seqs,
        encoder_cache_bytes=args.encoder_cache_mb << 20,
        vision=not args.no_vision, executable_cache=args.executable_cache, **advanced_kwargs(args),
        speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
        draft_model=args.draft_model, speculative_max_batch=args.speculative_max_batch,
        speculative_adaptive=not args.no_speculative_adaptive,
        speculative_on_gpu=args.speculative_on_gpu,
        **({"compilation_cache_dir": args.compilation_cache_dir} if args.compilation_cache_dir else {}))
    if eargs.speculative == "draft":       # a draft of another vocabulary is refused before anything loads
        from serving.spec.draft import check_draft_configs
        check_draft_configs(args.model, eargs.draft_model)
    t0 = time.perf_counter()
    set_stage("load")
    model = load_model(args.model, dtype=args.dtype, seed=args.seed, mesh=args.mesh, revision=args.revision,
                       download_dir=args.download_dir, **eargs.load_options())
    if model.tokenizer is None:
        raise ValueError(f"{args.model}: the server needs a tokenizer (tiktoken.model) in the checkpoint directory")
    log.info("loaded %r in %.1fs", model, time.perf_counter() - t0)
    set_stage("warmup")
    engine = LLMEngine(model, eargs, load_model=load_model)
    disagg = {}
    if args.role != "single":
        from serving.kv_transfer import Transport
        from serving.openai.disagg import PrefillPeer, PrefillService
        transport = Transport(args.transfer_address or f"{args.host}:0")
        disagg = ({"prefill_service": PrefillService(transport)} if args.role == "prefill" else
                  {"prefill_peer": PrefillPeer(args.prefill_peer, transport, args.prefill_timeout, args.api_key)})
        log.info("role %s: transfer server at %s", args.role, transport.address)
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if os.path.isdir(args.model)
                                      else args.model)
    return ServerState(engine=AsyncEngine(engine), tokenizer=model.tokenizer, model_name=name,
                       max_model_len=engine.max_model_len, metrics=Metrics(name), api_key=args.api_key,
                       request_matcher=request_matcher,
                       thinks_by_default={"on": True, "off": False}.get(args.reasoning, model.config.thinks_by_default),
                       vision=_image_loader(model, args), max_n=args.max_n,
                       max_prompts=args.max_prompts_per_request, max_waiting=args.max_waiting,
                       stream_send_timeout=args.stream_send_timeout if args.stream_send_timeout > 0 else None,
                       max_body_bytes=int(args.max_body_mb * 2**20) if args.max_body_mb > 0 else None,
                       response_store_size=args.responses_store_size, response_store_ttl_s=args.responses_store_ttl,
                       **disagg)


def _image_loader(model, args):
    if model.vision is None or args.no_vision:
        return None
    from serving.image_inputs import ImageLoader, ImagePolicy
    return ImageLoader(model.vision, ImagePolicy(
        allow_remote=args.allow_remote_images, allow_local=args.image_dir is not None, max_bytes=int(args.max_image_mb * 2**20),
        timeout_s=args.image_fetch_timeout, local_dir=args.image_dir))


def main(argv=None, *, fault_hook=None, request_matcher=None):
    """Serve. fault_hook(stage, process_index): called at every fault point of a multi-host run
    (serving.multihost_watch.WatchSettings); request_matcher(req, state): a matcher factory constraining a
    chat request's output (serving.openai.generation.ServerState). Both are for tests
    (tests/support/serve_with_hooks.py installs them); the CLI sets neither."""
    args = parse_args(argv)
    claim_device_memory()     # before multihost.start: JAX reads it when its backend starts
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # JAX probes every platform plugin and logs each one missing ("Unable to initialize backend 'tpu'") at
    # INFO on every start: noise for a server, so only its warnings
    logging.getLogger("jax._src.xla_bridge").setLevel(max(logging.WARNING, logging.getLogger().level))
    from serving import multihost, multihost_watch
    args.mesh = multihost.start(args.coordinator, args.num_processes, args.process_id, mesh=args.mesh,
                                heartbeat_timeout_s=args.heartbeat_timeout)
    if not multihost.is_multiprocess():
        return _serve(args, request_matcher)
    watch = multihost_watch.start(multihost_watch.WatchSettings(
        heartbeat_timeout_s=args.heartbeat_timeout, startup_timeout_s=args.startup_timeout,
        step_timeout_s=args.step_timeout, fault_hook=fault_hook))
    if not multihost.is_leader():
        return follow(args)
    try:
        code = _serve(args, request_matcher)
    except Exception as e:  # noqa: BLE001 - a failure on process 0 ends every process (never returns)
        watch.fail(e, code=2 if isinstance(e, ValueError) else 1)
    except SystemExit:     # SIGTERM: a clean exit
        code = 0
    if code:
        watch.end(f"process 0 exited with status {code} during {watch.stage}", code)
    watch.stop()
    multihost.shutdown_followers()
    return code


def guard_settings(args):
    """The slow-client limits of the command line (serving/openai/http_guard.py)."""
    from serving.openai.http_guard import GuardSettings, default_max_connections
    cap = default_max_connections() if args.max_connections is None else args.max_connections or None
    return GuardSettings(header_timeout=args.header_timeout or None, body_timeout=args.body_timeout or None,
                         max_connections=cap)


def uvicorn_config(app, args, metrics):
    """uvicorn's settings: its h11 protocol with the slow-client guard (the one protocol the guard is for)."""
    import uvicorn
    from serving.openai.http_guard import Guard
    guard = Guard(guard_settings(args), count=metrics.count_closed)
    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                          http=guard.protocol_class())


def _serve(args, request_matcher=None):
    try:
        import uvicorn  # noqa: F401 - (uvicorn_config uses it)
        from serving.openai.app import build_app
    except ImportError as e:
        print(f"error: the server needs fastapi and uvicorn ({e}); pip install -e .", file=sys.stderr)
        return 2
    from serving import multihost_watch
    try:
        state = build_state(args, request_matcher)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        if multihost_watch.current():
            raise           # main() ends the other processes too
        return 2
    app = build_app(state)
    from serving.openai.shutdown import GracefulServer
    server = GracefulServer(uvicorn_config(app, args, state.metrics), state.engine, args.shutdown_timeout)
    state.metrics.connections = server.server_state.connections
    log.info("serving %s at http://%s:%d/v1 (OpenAI-compatible)%s", state.model_name, args.host, args.port,
             " with API key" if args.api_key else "")
    # uvicorn re-raises SIGTERM after its graceful shutdown, which would kill the process before the
    # `finally` below; exit through it instead (multi-host: process 0 must still stop the followers).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    watch = multihost_watch.current()
    if watch:         # a lost process: fail in-flight requests with a 503, /health tells why
        watch.on_abort(state.engine.fail)
        state.engine.on_error = watch.fail
    multihost_watch.set_stage("serve")
    # The model, JAX and the app are loaded and live as long as the process: out of the garbage collector's
    # sight, a full collection (triggered by a large request's many objects) no longer walks them all while
    # holding the GIL, a pause every other request, /health included, would wait out.
    gc.freeze()
    try:
        server.run()
    finally:
        state.engine.shutdown(args.shutdown_timeout)
        log.info("engine stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
