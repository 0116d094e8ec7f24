"""The `pdserve` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pdserve.config import EngineConfig


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return int(args.func(args) or 0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="run prompts through the engine in one process, one continuous batch")
    _add_model_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    gen.set_defaults(func=_generate)

    fetch = sub.add_parser("fetch", help="fetch and convert a built-in model into the cache, once")
    fetch.add_argument("--model", default="smollm2-135m")
    fetch.set_defaults(func=_fetch)

    bench = sub.add_parser("bench", help="micro-benchmarks against a baseline measured in the same run")
    bench_sub = bench.add_subparsers(required=True, metavar="WHAT")
    engine = bench_sub.add_parser("engine", help="prefill and decode tokens/s, engine vs transformers")
    _add_model_args(engine)
    engine.add_argument("--batch-sizes", default="1,8,32")
    engine.add_argument("--prompt-len", type=int, default=512, help="prompt tokens for the prefill figure")
    engine.add_argument("--decode-prompt-len", type=int, default=32, help="prompt tokens before decoding")
    engine.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per sequence")
    engine.add_argument("--compare", choices=["transformers", "none"], default="transformers")
    engine.set_defaults(func=_bench_engine)
    transfer = bench_sub.add_parser("transfer", help="KV transfer GB/s between two processes vs raw gloo and a copy")
    transfer.add_argument("--host", default="127.0.0.1", help="address both processes bind")
    transfer.add_argument("--device", default="cpu", help="where the KV caches live: cpu, cuda, cuda:N")
    transfer.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    transfer.add_argument("--tokens", type=int, default=1000, help="sequence length of the SmolLM2 cases")
    transfer.add_argument("--mib", type=int, default=64, help="size of the large case")
    transfer.add_argument("--repeats", type=int, default=7)
    transfer.add_argument("--pipeline-depth", type=int, default=4, help="layers in flight")
    transfer.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    transfer.set_defaults(func=_bench_transfer)
    return parser


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, tiny-random, a model folder or a .gguf")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:N")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, num_threads=args.threads)


def _fetch(args: argparse.Namespace) -> int:
    from pdserve.engine.models import ModelFetchError, resolve_model

    try:
        print(resolve_model(args.model))
    except ModelFetchError as e:
        print(f"pdserve fetch: {e}", file=sys.stderr)
        return 1
    return 0


def _generate(args: argparse.Namespace) -> int:
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.errors import InvalidRequestError

    try:
        sampling = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
        engine = LLMEngine(_engine_config(args))
        tok = engine.tokenizer
        prompts = [tok.apply_chat_template([("user", p)]) if args.chat else tok.encode(p) for p in args.prompt]
        completions = engine.generate(prompts, sampling)
    except InvalidRequestError as e:
        print(f"pdserve generate: invalid {e}", file=sys.stderr)
        return 2
    for prompt, c in zip(args.prompt, completions, strict=True):
        if args.json:
            reason = c.finish_reason.value
            record = {"prompt": prompt, "token_ids": c.token_ids, "text": c.text, "finish_reason": reason}
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(f"### {prompt}\n{c.text}\n[{len(c.token_ids)} tokens, {c.finish_reason.value}]\n")
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    from pdserve.bench.engine_bench import run_engine_bench

    run_engine_bench(
        _engine_config(args),
        batch_sizes=[int(b) for b in args.batch_sizes.split(",")],
        prompt_len=args.prompt_len,
        decode_prompt_len=args.decode_prompt_len,
        decode_tokens=args.decode_tokens,
        compare_transformers=args.compare == "transformers",
    )
    return 0


def _bench_transfer(args: argparse.Namespace) -> int:
    from pdserve.bench.transfer_bench import default_cases, run_transfer_bench

    result = run_transfer_bench(
        default_cases(args.tokens, args.mib),
        host=args.host,
        device=args.device,
        backend=args.backend,
        repeats=args.repeats,
        pipeline_depth=args.pipeline_depth,
    )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
