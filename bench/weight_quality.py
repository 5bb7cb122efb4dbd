"""How much each weight format changes the model's output, on a fixed prompt set.

For each prompt, the dense bf16 model's greedy continuation (--tokens long) is the reference.
Each format (int8, and q4 on each of its kernels) is then measured these ways:

  teacher-forced agreement  fed the reference's prompt + continuation, the share of continuation
                            positions where the format's top token is the reference's token;
  largest logit difference  over those same positions, the largest |logit - reference logit|;
  free-running prefix       the format's own greedy continuation: how many tokens it shares with
                            the reference before the first difference (median over prompts).

With --llama-server PATH (a llama.cpp build; not a pdserve dependency), the same prompts are sent
to llama-server serving the same Q4_1 GGUF (greedy, --tokens each, 1 slot), and q4's and dense's
continuations are compared with llama.cpp's the same way (teacher-forced on llama.cpp's tokens).

  .venv/bin/python bench/weight_quality.py
  .venv/bin/python bench/weight_quality.py --llama-server /path/to/llama-server
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

import torch

from common import write_results
from peers import healthy
from pdserve.localstack import free_port, wait_until
from pdserve.models.gguf_import import smollm2_gguf_path
from pdserve.models.loading import load_served_model

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "smollm2-135m-instruct"
# --weights, and for q4 the kernel after a colon (--q4-kernel: each rounds differently).
FORMATS = ("dense", "int8", "q4:torch", "q4:native")
PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
    "The three primary colors are",
    "In 1969, the first humans",
    "A good way to learn a new language is",
    "The quick brown fox",
    "Water boils at a temperature of",
    "The most important rule of cooking is",
    "import numpy as np\n",
    "My favourite book is",
    "The stock market fell today because",
    "Dear hiring manager,",
    "The theory of relativity states that",
    "Here is a list of fruits: apple,",
]


def _load(fmt: str):
    weights, _, kernel = fmt.partition(":")  # q4:native, q4:torch (--q4-kernel)
    return load_served_model(MODEL, weight_format=weights, q4_kernel=kernel or "torch")


def greedy(model, prompt: list[int], tokens: int) -> list[int]:
    cache: list = []
    logits = model.forward_contiguous(prompt, cache)
    out: list[int] = []
    for _ in range(tokens):
        out.append(int(logits[-1].argmax()))
        logits = model.forward_contiguous([out[-1]], cache)
    return out


def forced_logits(model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Logits predicting each continuation token, given the prompt and the tokens before it."""
    logits = model.forward_contiguous(prompt + continuation[:-1], [])
    return logits[len(prompt) - 1 :]


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def compare(model, prompts: list[list[int]], refs: list[list[int]], ref_model=None) -> dict:
    """`model` against reference continuations `refs` (and `ref_model`'s logits, if given)."""
    agree = total = 0
    largest = 0.0
    prefixes = []
    for prompt, ref in zip(prompts, refs):
        logits = forced_logits(model, prompt, ref)
        agree += int((logits.argmax(-1) == torch.tensor(ref)).sum())
        total += len(ref)
        if ref_model is not None:
            largest = max(
                largest, float((logits - forced_logits(ref_model, prompt, ref)).abs().max())
            )
        prefixes.append(shared_prefix(greedy(model, prompt, len(ref)), ref))
    out = {
        "teacher_forced_agreement": agree / total,
        "free_running_shared_prefix_median": statistics.median(prefixes),
        "free_running_identical": sum(p == len(r) for p, r in zip(prefixes, refs)),
        "prompts": len(prompts),
    }
    if ref_model is not None:
        out["largest_logit_difference"] = largest
    return out


def llama_server_continuations(binary: str, prompts: list[list[int]], tokens: int) -> list:
    port = free_port()
    command = [binary, "-m", str(smollm2_gguf_path()), "--port", str(port), "-t", "2"]
    command += ["-c", "2048", "--parallel", "1", "--host", "127.0.0.1"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: healthy(port), 120, "llama-server healthy")
        return [_llama_complete(port, p, tokens) for p in prompts]
    finally:
        proc.terminate()
        proc.wait(30)


def _llama_complete(port: int, prompt: list[int], tokens: int) -> list[int]:
    body = {
        "prompt": prompt,
        "n_predict": tokens,
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": True,
        "cache_prompt": False,
        "return_tokens": True,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        return list(json.load(r)["tokens"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=32, help="continuation length per prompt")
    p.add_argument("--llama-server", default="", help="llama-server binary, for q4 vs llama.cpp")
    p.add_argument("--out", default=str(RESULTS / "weight_quality.json"))
    args = p.parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()
    models = {f: _load(f) for f in FORMATS}
    tokenizer = models["dense"].tokenizer
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    dense = models["dense"].built
    refs = [greedy(dense, prompt, args.tokens) for prompt in prompts]
    results = {fmt: compare(models[fmt].built, prompts, refs, dense) for fmt in FORMATS[1:]}
    if args.llama_server:
        llama = llama_server_continuations(args.llama_server, prompts, args.tokens)
        results["vs_llama_server"] = {
            fmt: compare(models[fmt].built, prompts, llama) for fmt in FORMATS if fmt != "int8"
        }
    for name, figures in results.items():
        print(name, json.dumps(figures))
    conditions = {
        "model": MODEL,
        "reference": "dense weights in bfloat16, greedy",
        "prompts": PROMPTS,
        "continuation_tokens": args.tokens,
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - started, 1),
    }
    write_results(args.out, conditions, results=results)


if __name__ == "__main__":
    main()
