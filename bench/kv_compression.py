"""What int8 KV compression on the wire does to the output: bytes saved, token agreement, logits.

For each prompt of a fixed set, the served model prefills the prompt, then greedily generates
--tokens tokens twice: once from the exact prompt KV, and once from the prompt KV after the
int8 round trip that `--kv-compression int8` applies on the wire (pdserve.kv.compression). KV that
decode computes itself stays exact in both runs, as in the services. Reports, per prompt and in
total: greedy tokens identical before the first divergence, the largest logit difference over the
steps both runs share, and the bytes on the wire with and without compression.

  .venv/bin/python bench/kv_compression.py --json bench/results/kv_compression.json
"""

import argparse
import platform

import torch

from common import write_results  # bench/ is the script's directory
from pdserve.kv import compression
from pdserve.models.loading import load_served_model
from pdserve.models.tokenizer import ChatMessage

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 20.",
    "Translate 'good morning' into Spanish and German.",
    "What does a CPU cache do?",
    "Give me a short tip for learning to cook.",
    "Summarise the plot of Romeo and Juliet in one sentence.",
]


def round_trip(cache) -> list:
    """The cache as decode would hold it after an int8 handoff."""
    out = []
    for k, v in cache:
        scales, values = compression.quantize(torch.stack((k, v)))
        both = compression.dequantize(scales, values, k.dtype)
        out.append((both[0], both[1]))
    return out


def greedy(model, cache, first_token: int, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    tokens, logits_seen = [first_token], []
    for _ in range(steps - 1):
        logits = model.forward_contiguous([tokens[-1]], cache)[-1]
        logits_seen.append(logits)
        tokens.append(int(logits.argmax()))
    return tokens, logits_seen


def compare(served, prompt: str, steps: int) -> dict:
    model, config = served.built, served.config
    ids = served.tokenizer.render_chat([ChatMessage("user", prompt)])
    exact_cache: list = []
    first = int(model.forward_contiguous(ids, exact_cache)[-1].argmax())
    lossy_cache = round_trip(exact_cache)
    exact, exact_logits = greedy(model, exact_cache, first, steps)
    lossy, lossy_logits = greedy(model, lossy_cache, first, steps)
    agree = next((i for i, (a, b) in enumerate(zip(exact, lossy)) if a != b), steps)
    shared = max(0, agree - 1)  # logits of steps whose inputs were still the same token
    max_diff = max(
        (float((a - b).abs().max()) for a, b in zip(exact_logits[:shared], lossy_logits[:shared])),
        default=0.0,
    )
    raw = len(ids) * config.kv_bytes_per_token
    wire = config.n_layers * compression.int8_payload_bytes(
        len(ids), config.kv_heads, config.head_dim
    )
    return {
        "prompt": prompt,
        "prompt_tokens": len(ids),
        "tokens_identical_before_divergence": agree,
        "all_identical": exact == lossy,
        "max_logit_diff_while_identical": round(max_diff, 4),
        "kv_bytes": raw,
        "wire_bytes_int8": wire,
        "exact_text": served.tokenizer.decode(exact),
        "int8_text": served.tokenizer.decode(lossy),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="", help="KV and weights dtype (default: the model's)")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    served = load_served_model(args.model, args.dtype)
    rows = [compare(served, p, args.tokens) for p in PROMPTS]
    for r in rows:
        print(
            f"{r['prompt_tokens']:4d} prompt tokens: {r['tokens_identical_before_divergence']:3d}"
            f"/{args.tokens} identical, max logit diff {r['max_logit_diff_while_identical']:.3f}, "
            f"wire {r['wire_bytes_int8'] / r['kv_bytes']:.3f}x"
        )
    identical = sum(r["all_identical"] for r in rows)
    print(f"{identical}/{len(rows)} prompts gave identical greedy output")
    if args.json:
        conditions = {
            "model": served.name,
            "dtype": served.config.dtype,
            "tokens": args.tokens,
            "torch": torch.__version__,
            "python": platform.python_version(),
        }
        write_results(args.json, conditions, rows=rows)


if __name__ == "__main__":
    main()
