"""`jaxserve` command line: serve (gRPC + HTTP), generate (offline), client, bench, plan,
convert."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time

from jaxserve.config import (
    DTYPES, KERNEL_IMPLS, KV_CACHE_DTYPES, LM_HEAD_QUANTIZATIONS, QUANTIZATIONS, EngineConfig)
from server.tool_parsers import PARSERS
from sharding.strategies import STRATEGIES


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face checkpoint directory (default: the built-in demo model)")
    g.add_argument("--config", default=None, help="engine settings YAML (e.g. configs/engine/cpu.yaml)")
    g.add_argument("--dtype", choices=DTYPES, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--page-size", type=int, default=None)
    g.add_argument("--num-pages", type=int, default=None)
    g.add_argument("--kv-cache-memory-gib", type=float, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--token-buckets", default=None, metavar="N,N,...",
                   help="the step sizes compiled at start-up, in tokens (default: 1, 8 and "
                        "powers of two up to --max-num-batched-tokens); fewer buckets start "
                        "faster, a batch pads up to the next one")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                   help="keep the KV pages the prefix cache evicts in this much host memory "
                        "(GiB) and copy them back for prompts that share their prefix")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=None,
                   help="fcfs (default): requests run in arrival order; priority: a "
                        "request's `priority` (lower first, then arrival) orders admission "
                        "and preemption")
    g.add_argument("--num-scheduler-steps", type=int, default=None, metavar="N",
                   help="run up to N decode steps in one program while every request "
                        "decodes (default 1); tokens then stream N at a time")
    g.add_argument("--quantization", choices=list(QUANTIZATIONS), default=None,
                   help="quantize the linear layers' weights at load (a checkpoint made by "
                        "`jaxserve convert`, AWQ, GPTQ or compressed-tensors is served as "
                        "stored)")
    g.add_argument("--quant-group-size", type=int, default=None, metavar="G",
                   help="int4 / int8 / fp4: rows per scale group when jaxserve quantizes "
                        "(int4 default 128, fp4 32, int8 default per output channel; it "
                        "must divide every layer's input width)")
    g.add_argument("--quant-zero-points", action="store_true",
                   help="int4 / int8: asymmetric groups with zero points (GPTQ's min-max)")
    g.add_argument("--lm-head-quantization", choices=list(LM_HEAD_QUANTIZATIONS),
                   default=None,
                   help="quantize the LM head too (a tied one as a copy; a GGUF file's "
                        "quantized head is kept as stored without it)")
    g.add_argument("--lm-head-group-size", type=int, default=None, metavar="G",
                   help="rows per scale group of the quantized LM head (int4 default 128, "
                        "int8 default per output channel)")
    g.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=None,
                   help="KV cache storage: auto (the model dtype), int8 or fp8 (e4m3), with "
                        "a scale per token and head")
    g.add_argument("--kernel-impl", choices=list(KERNEL_IMPLS), default=None,
                   help="attention / matmul kernels (default: by platform)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--mesh", default=None, metavar="data=D,model=M",
                   help="device mesh, e.g. model=4 or data=2,model=4 (default: one device)")
    g.add_argument("--sharding", default=None, choices=STRATEGIES,
                   help="sharding strategy over the mesh (default: tp)")
    g.add_argument("--compilation-cache-dir", default=None, metavar="DIR",
                   help="keep compiled step programs here across restarts (default: under "
                        "~/.cache/jaxserve, or $JAX_COMPILATION_CACHE_DIR; 'off' for none)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (docs/lora.md)")
    g.add_argument("--max-loras", type=positive_int, default=None,
                   help="adapters on the device at once (default 4)")
    g.add_argument("--max-lora-rank", type=positive_int, default=None,
                   help="the largest adapter rank taken (default 16)")
    g.add_argument("--max-cpu-loras", type=positive_int, default=None,
                   help="adapters kept in host memory (default --max-loras)")
    g.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                   help='the most images one prompt may carry, as vLLM\'s: e.g. '
                        '\'{"image": 2}\' (default: as many as the encoder cache holds)')
    g.add_argument("--mm-encoder-cache-tokens", type=positive_int, default=None,
                   metavar="N", help="rows of image embeddings kept on the device (default: "
                                     "8 images' worth, at least --max-num-batched-tokens)")
    g.add_argument("--hf-overrides", default=None, metavar="JSON",
                   help="keys set over the checkpoint's config.json, as vLLM's: e.g. a "
                        "reranker's head from LM head rows, '{\"classifier_from_token\": "
                        "[\"no\", \"yes\"], \"method\": \"from_2_way_softmax\"}' "
                        "(docs/http.md)")
    g.add_argument("--pooler-config", default=None, metavar="JSON",
                   help="how embeddings and classifications are pooled, over what the "
                        "checkpoint says, as vLLM's: e.g. '{\"pooling_type\": \"MEAN\", "
                        "\"use_activation\": false}' (docs/http.md)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM\'s: e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' (docs/speculative.md)')
    g.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help='one side of prefill/decode disaggregation, as vLLM\'s: '
                        '\'{"kv_role": "kv_producer"}\' (a prefill server; "kv_port": N '
                        'for its K/V service) or \'{"kv_role": "kv_consumer"}\' (a decode '
                        'server); `jaxserve router` in front (docs/disaggregation.md)')


def parse_mesh(text: str | None) -> dict[str, int] | None:
    """'data=2,model=4' -> {'data': 2, 'model': 4}."""
    if not text:
        return None
    mesh = {}
    for part in text.split(","):
        name, sep, size = part.partition("=")
        if not sep or not size.strip().isdigit():
            raise ValueError(f"--mesh {text!r}: write axis=size pairs, e.g. data=2,model=4")
        mesh[name.strip()] = int(size)
    return mesh


def parse_buckets(text: str | None) -> tuple[int, ...] | None:
    """'16,64' -> (16, 64)."""
    if not text:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--token-buckets {text!r}: write token counts, e.g. 16,64") from None


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_lora_modules(items: list[str] | None) -> list[tuple[str, str]]:
    """['name=path', ...] -> [(name, path), ...]."""
    out = []
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {item!r}: write name=path, e.g. "
                             "sql=/adapters/sql-lora")
        out.append((name, path))
    return out


def parse_json_object(flag: str, text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: give a JSON object, e.g. '{{\"method\": \"ngram\"}}'")
    return value


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    overrides = {
        "model": args.model, "dtype": args.dtype, "max_model_len": args.max_model_len,
        "page_size": args.page_size, "num_pages": args.num_pages,
        "kv_cache_memory_gib": args.kv_cache_memory_gib, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_scheduler_steps": args.num_scheduler_steps,
        "token_buckets": parse_buckets(args.token_buckets), "seed": args.seed,
        "enable_prefix_caching": False if args.no_prefix_caching else None,
        "kv_offloading_size": args.kv_offloading_size,
        "scheduling_policy": args.scheduling_policy,
        "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
        "quant_group_size": args.quant_group_size,
        "quant_zero_points": True if args.quant_zero_points else None,
        "lm_head_quantization": args.lm_head_quantization,
        "lm_head_group_size": args.lm_head_group_size,
        "kernel_impl": args.kernel_impl, "mesh": parse_mesh(args.mesh),
        "sharding": args.sharding, "compilation_cache_dir": args.compilation_cache_dir,
        "speculative_config": parse_json_object("--speculative-config",
                                                args.speculative_config),
        "hf_overrides": parse_json_object("--hf-overrides", args.hf_overrides),
        "pooler_config": parse_json_object("--pooler-config", args.pooler_config),
        "enable_lora": True if args.enable_lora else None, "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank, "max_cpu_loras": args.max_cpu_loras,
        "limit_mm_per_prompt": parse_json_object("--limit-mm-per-prompt",
                                                 args.limit_mm_per_prompt),
        "mm_encoder_cache_tokens": args.mm_encoder_cache_tokens,
        "kv_transfer_config": parse_json_object("--kv-transfer-config",
                                                args.kv_transfer_config),
    }
    if args.config:
        return EngineConfig.from_yaml(args.config, **overrides)
    return EngineConfig(**{k: v for k, v in overrides.items() if v is not None})


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxserve.demo import DEMO_NOTICE
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    if config.model is None:
        print(DEMO_NOTICE, file=sys.stderr)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        max_tokens=args.max_tokens, seed=args.seed_sampling, ignore_eos=args.ignore_eos,
        stop=args.stop or None, repetition_penalty=args.repetition_penalty)
    llm = LLM(warmup=True, **{**dataclasses.asdict(config), "model": config.model})
    prompts = args.prompt or ["Hello, my name is"]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for out in outputs:
        c = out.outputs[0]
        print(f"--- prompt: {out.prompt!r}")
        print(c.text)
        print(f"--- {len(c.token_ids)} tokens, finish_reason={c.finish_reason}")
    total = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tokens/s)", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from jaxserve.demo import DEMO_NOTICE
    from jaxserve.engine import broadcast
    from jaxserve.loading.media import MediaPolicy
    from server.app import serve
    from server.engine_core import EngineProcess, EngineThread, build_engine
    from server.security import Security
    from sharding import multihost

    config = engine_config_from_args(args)
    lora_modules = parse_lora_modules(args.lora_modules)
    if lora_modules and not config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    security = Security.from_args(args)  # bad files or an open address fail before loading
    security.check_bind(args.host)
    dist = multihost.DistributedConfig.from_args(args.coordinator, args.num_processes,
                                                 args.process_id,
                                                 args.distributed_heartbeat_timeout)
    if args.random_weights:
        name = f"{args.random_weights} (random weights)"
    else:
        if config.model is None:
            logging.warning(DEMO_NOTICE)
        name = config.model or "demo"
    if dist is None and not args.engine_thread:  # the engine in a process of its own
        core = EngineProcess(config, args.random_weights, lora_modules, args.max_waiting,
                             args.stream_interval)
        core.load()  # raises what loading raised; it warms up once the ports are open
    else:  # multi-host: every process's engine runs in it (jax.distributed)
        if dist is not None:
            multihost.initialize(dist)
        leader = dist is None or dist.process_id == 0
        broadcaster = broadcast.StepBroadcaster() if dist is not None and leader else None
        # (followers are sent the adapters' arrays by process 0: they read none)
        engine = build_engine(config, args.random_weights, lora_modules if leader else (),
                              broadcaster)
        if not leader:
            engine.warmup()
            logging.info("process %d: following process 0's steps", dist.process_id)
            try:
                broadcast.follow(engine)
            except Exception as e:  # noqa: BLE001 - process 0 or a peer is gone
                logging.error("process %d: lost the other processes (%s); exiting",
                              dist.process_id, str(e).splitlines()[0])
                multihost.exit_now(1)
            return 0
        core = EngineThread(engine, args.max_waiting, warmup=True,
                            stream_interval=args.stream_interval)
    code = asyncio.run(serve(core, host=args.host, port=args.port, grace_s=args.grace,
                             model_name=args.served_model_name or name,
                             http_port=None if args.no_http else args.http_port,
                             max_prompt_bytes=args.max_prompt_bytes, security=security,
                             tool_call_parser=args.tool_call_parser,
                             reasoning_parser=args.reasoning_parser,
                             media=MediaPolicy(tuple(args.allowed_media_domains or ()),
                                               args.allowed_local_media_path)))
    if dist is not None and code != 0:
        multihost.exit_now(code)
    return code


def cmd_router(args: argparse.Namespace) -> int:
    import asyncio

    from server.router import Router

    router = Router(args.prefill, args.decode, args.timeout, args.prefill_grpc,
                    args.decode_grpc)
    asyncio.run(router.serve(args.host, args.port, args.grpc_port))
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from server.bench import main as bench_main

    return bench_main(args)


def cmd_client(args: argparse.Namespace) -> int:
    from server.client import run_cli

    return run_cli(args)


def cmd_plan(args: argparse.Namespace) -> int:
    from jaxserve.loading.source import open_checkpoint
    from sharding.plan_report import check_plot, format_compare, format_plan, plot_memory
    from sharding.planner import gpu_target, parse_compare, plan_target

    if args.compare and (args.topology or args.target):
        raise ValueError("--compare names its own targets (e.g. v5e:2x2/tp,h100x8/tp): "
                         "leave out --topology and --target")
    if args.topology and args.target:
        raise ValueError("--topology (a TPU slice, e.g. v5e:2x2) and --target (GPUs, e.g. "
                         "h100x8) are mutually exclusive: give one")
    if not (args.compare or args.topology or args.target):
        raise ValueError("say what to plan for: --topology v5e:2x2 (TPU), --target h100x8 "
                         "(GPU) or --compare v5e:2x2/tp,h100x8/tp")
    if args.topology and gpu_target(args.topology) is not None:
        raise ValueError(f"--topology {args.topology!r} is not a TPU slice (GENERATION:AxB, "
                         f"e.g. v5e:2x2); GPUs go to --target")
    if args.target and gpu_target(args.target) is None:
        raise ValueError(f"--target {args.target!r} is not a GPU target (e.g. h100x8); TPU "
                         f"slices go to --topology")
    if args.plot:
        check_plot(args.plot)  # before minutes of compiling, not after
    ckpt = open_checkpoint(args.model, args.quantization)  # sized as stored, if quantized
    cfg = ckpt.config
    common = dict(dtype=args.dtype, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size,
                  data_parallel=args.data_parallel, max_loras=args.max_loras,
                  max_lora_rank=args.max_lora_rank)
    settings = dict(ckpt.settings)
    quantization = settings.pop("quantization", args.quantization)
    common.update(settings)
    if args.compare:
        configs = parse_compare(args.compare, args.strategy, quantization,
                                args.kv_cache_dtype)
        plans = [plan_target(cfg, **c, **common) for c in configs]
        print(format_compare(plans))
    else:
        plans = [plan_target(cfg, args.topology or args.target, strategy=args.strategy,
                             quantization=quantization,
                             kv_cache_dtype_name=args.kv_cache_dtype, **common)]
        print(format_plan(plans[0]))
    if args.plot:
        plot_memory(plans, args.plot)
        print(f"wrote {args.plot}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from jaxserve.loading.converted import convert, read_manifest
    from jaxserve.loading.source import open_checkpoint
    from sharding.mesh import make_mesh
    from sharding.rules import model_sharding

    cfg = open_checkpoint(args.model, args.quantization).config
    shard = model_sharding(make_mesh(parse_mesh(args.mesh)), "tp", cfg)
    out = convert(args.model, args.out, args.dtype, args.quantization, shard)
    manifest = read_manifest(out)
    source = manifest["source_quantization"]
    print(f"wrote {out} ({manifest['quantization'] or 'unquantized'} weights"
          f"{f' as stored by {source}' if source else ''}, {args.dtype}); serve it with: "
          f"jaxserve serve --model {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxserve", description="jaxserve: a JAX/XLA LLM inference server for TPU and GPU")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline from prompts",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--stop", action="append", help="a stop string (repeat for several)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--seed-sampling", type=int, default=None, help="per-request sampling seed")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve the model over gRPC and OpenAI-compatible HTTP",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all)")
    srv.add_argument("--port", type=int, default=50051, help="gRPC port")
    srv.add_argument("--http-port", type=int, default=8000,
                     help="OpenAI-compatible HTTP port (same host and engine as gRPC)")
    srv.add_argument("--no-http", action="store_true", help="serve gRPC only")
    srv.add_argument("--tls-cert", default=None, help="PEM certificate: serve gRPC and HTTP "
                                                      "over TLS (with --tls-key)")
    srv.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    srv.add_argument("--tls-client-ca", default=None,
                     help="PEM CA: also require client certificates it signed (mutual TLS)")
    srv.add_argument("--api-key", action="append", default=None,
                     help="require 'authorization: Bearer KEY' on every RPC and HTTP route "
                          "but health (repeatable: several clients, several keys)")
    srv.add_argument("--api-key-file", default=None, help="API keys, one per line")
    srv.add_argument("--admin-key", action="append", default=None,
                     help="a key that may also read server status and abort anyone's "
                          "requests (repeatable)")
    srv.add_argument("--reflection", action="store_true",
                     help="keep gRPC reflection on when API keys are required")
    srv.add_argument("--insecure", action="store_true",
                     help="serve a non-loopback --host without TLS or API keys")
    srv.add_argument("--max-prompt-bytes", type=int, default=None,
                     help="longest prompt text taken, checked before tokenizing (default: 32 "
                          "bytes per token of max_model_len); gRPC messages and HTTP bodies are "
                          "limited to twice this plus 1 MiB")
    srv.add_argument("--stream-interval", type=positive_int, default=1,
                     help="tokens a streamed message holds at least, but a stream's first and "
                          "last (default 1: every step's tokens at once); larger values cost "
                          "the server less per token when many streams run")
    srv.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                     help="LoRA adapters (PEFT directories) served as models of these names "
                          "(with --enable-lora)")
    srv.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                     help="hosts (and their subdomains) chat messages' http(s) image URLs "
                          "may name; without it only data: URLs are read")
    srv.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                     help="file:// image URLs must lie under this directory (without it "
                          "they are refused)")
    srv.add_argument("--served-model-name", default=None,
                     help="the model name clients send (default: the --model path, or "
                          "'demo')")
    srv.add_argument("--tool-call-parser", default=None,
                     choices=list(PARSERS),
                     help="read tool calls in this format out of model output, for "
                          "tool_choice \"auto\" on /v1/chat/completions (docs/http.md)")
    srv.add_argument("--reasoning-parser", default=None,
                     choices=["deepseek_r1", "qwen3", "openai_gptoss"],
                     help="split a thinking model's <think> block (openai_gptoss: gpt-oss's "
                          "analysis channel) from its chat answers into reasoning_content "
                          "(docs/http.md)")
    srv.add_argument("--engine-thread", action="store_true",
                     help="run the engine loop on a thread of the server's process instead "
                          "of a process of its own (as multi-host's process 0 does); the "
                          "engine then shares one GIL with the servers")
    srv.add_argument("--max-waiting", type=int, default=1024,
                     help="waiting requests before new ones get RESOURCE_EXHAUSTED")
    srv.add_argument("--grace", type=float, default=30.0,
                     help="seconds in-flight requests get to finish on SIGTERM")
    srv.add_argument("--random-weights", default=None, metavar="PRESET_YAML",
                     help="serve random weights of a model preset (no tokenizer: token-id "
                          "prompts only), e.g. configs/models/smollm2-135m.yaml, for benchmarks")
    add_engine_args(srv)
    multi = srv.add_argument_group("multi-host (every process runs the same command; process 0 "
                                   "serves gRPC)")
    multi.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="process 0's coordination address (env JAX_COORDINATOR_ADDRESS)")
    multi.add_argument("--num-processes", type=int, default=None,
                       help="processes in the job (env JAX_NUM_PROCESSES)")
    multi.add_argument("--process-id", type=int, default=None,
                       help="this process's index, 0 for the leader (env JAX_PROCESS_ID)")
    multi.add_argument("--distributed-heartbeat-timeout", type=int, default=None,
                       metavar="SECONDS",
                       help="a process silent this long (dead, stopped, off the network, "
                            "even mid-step) ends the whole job: process 0 aborts, so a "
                            "supervisor restarts it (JAX's heartbeat timeout; default 100)")
    srv.set_defaults(func=cmd_serve)

    cli = sub.add_parser("client", help="call a running server")
    cli.add_argument("--target", default="127.0.0.1:50051")
    cli.add_argument("--api-key", default=None, help="for a server started with --api-key")
    cli.add_argument("--tls-ca", default=None,
                     help="PEM CA to trust for a server started with --tls-cert ('' for the "
                          "system's roots)")
    csub = cli.add_subparsers(dest="client_command", required=True)
    cgen = csub.add_parser("generate", help="generate from a prompt")
    cgen.add_argument("--prompt", required=True)
    cgen.add_argument("--max-tokens", type=int, default=64)
    cgen.add_argument("--temperature", type=float, default=0.0)
    cgen.add_argument("--seed", type=int, default=None)
    cgen.add_argument("--stream", action="store_true", help="print text as it arrives")
    shape = cgen.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="JSON_OR_FILE",
                       help="hold the output to this JSON Schema (docs/structured_output.md)")
    shape.add_argument("--json-object", action="store_true", help="any JSON object")
    shape.add_argument("--regex", help="the whole output matches this regular expression")
    shape.add_argument("--choice", action="append", help="one of these (repeat for several)")
    shape.add_argument("--grammar", metavar="TEXT_OR_FILE", help="a Lark or GBNF grammar")
    cchat = csub.add_parser("chat", help="chat interactively (the model's chat template), "
                                         "streaming each reply; an empty line or EOF ends")
    cchat.add_argument("--system", default=None, help="a system message to start with")
    cchat.add_argument("--max-tokens", type=int, default=256)
    cchat.add_argument("--temperature", type=float, default=0.7)
    cchat.add_argument("--seed", type=int, default=None)
    csub.add_parser("status", help="running/waiting requests, KV pages, tokens/s")
    csub.add_parser("info", help="model and engine facts")
    cli.set_defaults(func=cmd_client)

    pl = sub.add_parser("plan", help="compile for a TPU topology (needs libtpu) or a GPU node "
                                     "(emulated on CPU), without weights, and report per-chip "
                                     "memory and collectives",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    pl.add_argument("--model", required=True,
                    help="model preset YAML or checkpoint dir (e.g. configs/models/llama3-8b.yaml)")
    pl.add_argument("--topology", default=None,
                    help="TPU topology, e.g. v5e:2x2, v6e:2x4 (one of --topology, --target, "
                         "--compare)")
    pl.add_argument("--target", default=None,
                    help="GPU node: h100x1|x2|x4|x8, h200x1..x8, a100x1..x8; compiled by XLA:CPU "
                         "on as many CPU devices (temporaries and collectives are estimates)")
    pl.add_argument("--compare", default=None, metavar="TARGET[/STRATEGY[/WEIGHTS[/KV]]],...",
                    help="plan several configurations and print one table, e.g. "
                         "'v5e:2x2/tp,v5e:2x2/tp+sp,v5e:2x4/tp,v5e:2x2/tp/int8,h100x8/tp'; "
                         "fields left out take --strategy, --quantization, --kv-cache-dtype")
    pl.add_argument("--plot", default=None, metavar="PATH.png",
                    help="also draw per-chip memory (weights, KV, temporaries) against HBM "
                         "(needs matplotlib)")
    pl.add_argument("--strategy", default="tp", choices=STRATEGIES)
    pl.add_argument("--data-parallel", type=int, default=2, metavar="D",
                    help="data-parallel groups for dp+tp, dp+tp+sp, dp+ep and dp+tp+ep "
                         "(mesh data=D, model=chips/D; D=chips: each chip its own group); "
                         "dp alone puts every chip on data")
    pl.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    pl.add_argument("--max-model-len", type=int, default=4096)
    pl.add_argument("--max-num-seqs", type=int, default=64)
    pl.add_argument("--max-num-batched-tokens", type=int, default=512)
    pl.add_argument("--page-size", type=int, default=16)
    pl.add_argument("--quantization", choices=list(QUANTIZATIONS), default=None)
    pl.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto")
    pl.add_argument("--max-loras", type=int, default=0,
                    help="LoRA adapter slots the step carries (0: none); their memory is "
                         "counted on every chip")
    pl.add_argument("--max-lora-rank", type=int, default=16)
    pl.set_defaults(func=cmd_plan)

    conv = sub.add_parser("convert", help="quantize an HF checkpoint once and save it with "
                                          "Orbax, for fast loading",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    conv.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    conv.add_argument("--out", required=True, help="new directory for the converted checkpoint")
    conv.add_argument("--quantization", choices=list(QUANTIZATIONS), default=None)
    conv.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                      help="dtype of the weights left unquantized (embeddings, norms)")
    conv.add_argument("--mesh", default=None, metavar="data=D,model=M",
                      help="devices to hold the weights while converting (default: one)")
    conv.set_defaults(func=cmd_convert)

    rt = sub.add_parser("router", help="one OpenAI HTTP endpoint in front of prefill and "
                                       "decode servers (docs/disaggregation.md)")
    rt.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                    help="prefill servers' HTTP addresses (serve --kv-transfer-config "
                         "'{\"kv_role\": \"kv_producer\"}')")
    rt.add_argument("--decode", nargs="+", required=True, metavar="URL",
                    help="decode servers' HTTP addresses (kv_role kv_consumer)")
    rt.add_argument("--prefill-grpc", nargs="+", default=None, metavar="HOST:PORT",
                    help="the prefill servers' gRPC targets, in --prefill's order (for "
                         "--grpc-port)")
    rt.add_argument("--decode-grpc", nargs="+", default=None, metavar="HOST:PORT",
                    help="the decode servers' gRPC targets, in --decode's order")
    rt.add_argument("--host", default="127.0.0.1")
    rt.add_argument("--port", type=int, default=8080, help="the OpenAI HTTP API's port")
    rt.add_argument("--grpc-port", type=int, default=None,
                    help="also serve jaxserve.v1.Inference on this port")
    rt.add_argument("--timeout", type=float, default=600.0,
                    help="seconds a request may take on a server")
    rt.set_defaults(func=cmd_router)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    bserve = bsub.add_parser("serve", help="load a running server; TTFT, TPOT, throughput",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from server.bench import add_args as add_bench_args

    add_bench_args(bserve)
    bserve.set_defaults(func=cmd_bench_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no libtpu" noise
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad user input: say what, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
