"""The model runner: one forward pass over the batch a scheduler picked, and sampling after it.

Schedulers only pick: which running sequences decode a token, which prompt positions are
computed. The runner turns that pick into the model's inputs (each decode's newest token at its
position, then each prompt piece's tokens), builds the paged cache's view for the step, runs
the model and returns float32 logits: one row per decode, then one per piece that completes its
prompt. How a step is made fast (the weight format, fused projections, scratch buffers, threads)
is fixed when the model and the cache are built, never by a scheduler.

The decode scheduler, chunked prefill and the prefix-cached prefill all run through it, so a
step's inputs are assembled in one place (as nano-vllm's model_runner does).
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.core.block_pool import BlockTable
from pdserve.core.picked import Pick
from pdserve.engine.paged_cache import DecodeStepKv, PagedCache, PromptChunk
from pdserve.engine.sampling import Draw, sample
from pdserve.models.protocol import CausalLM, PagedKv


# A model's first pass makes what its later passes reuse: the dense copies that quantized layers
# multiply a pass of many rows by (models/quantized.py), oneDNN's kernels for their shapes. On a
# 2-vCPU Xeon with AMX (SmolLM2 q4, 2026-12-06) a 16-token prompt took 352 ms the first time and
# 24 ms the second, so a service that prefills runs one before its first request.
WARM_UP_TOKENS = 16


def warm_up(model: CausalLM) -> float:
    """One WARM_UP_TOKENS-token prompt through the model, on no cache of a request's; returns
    the seconds it took."""
    started = time.perf_counter()
    with torch.inference_mode():
        model.forward_contiguous(list(range(WARM_UP_TOKENS)), [])
    return time.perf_counter() - started


@dataclass(frozen=True)
class PromptPiece:
    """Positions [start, end) of one prompt, computed in this step into its table's blocks."""

    table: BlockTable
    prompt: Sequence[int]
    start: int
    end: int

    @property
    def completes(self) -> bool:
        """The piece ends its prompt, so the step samples its first token."""
        return self.end == len(self.prompt)


@dataclass(frozen=True)
class Decoding:
    """One running sequence in a step: its newest token, at position `cached` (its KV so far)."""

    table: BlockTable
    token: int
    cached: int


class ModelRunner:
    def __init__(self, model: CausalLM, cache: PagedCache, ending: frozenset[int]) -> None:
        """`ending`: the model's end-of-sequence token ids, which min_tokens holds back."""
        self.model, self.cache, self.ending = model, cache, ending

    def run(
        self,
        decodes: Sequence[Decoding],
        pieces: Sequence[PromptPiece] = (),
        wrap: Callable[[DecodeStepKv], PagedKv] | None = None,
    ) -> torch.Tensor:
        """One forward pass; `wrap` may stand a view of its own around the step's (prefill's
        prefix cache hands each layer's K and V on from there)."""
        tokens = [d.token for d in decodes]
        positions = [d.cached for d in decodes]
        rows = list(range(len(decodes)))
        for piece in pieces:
            piece.table.ensure(piece.end)
            tokens += piece.prompt[piece.start : piece.end]
            positions += range(piece.start, piece.end)
            if piece.completes:
                rows.append(len(tokens) - 1)
        view = self.cache.step_view(
            [d.table for d in decodes],
            positions[: len(decodes)],
            [PromptChunk(p.table, p.start, p.end) for p in pieces],
        )
        wanted = rows if pieces else None  # every decode's row, in order: no selection needed
        return self.model.decode_paged(tokens, positions, wrap(view) if wrap else view, wanted)

    def fork(self, table: BlockTable) -> BlockTable:
        """A table for another completion of `table`'s written prompt: it shares the blocks
        before the prompt's last token, and has its own copy of the block that token is in."""
        fork = table.fork()
        last = len(fork.blocks) - 1
        self.cache.copy_block(table.blocks[last], fork.blocks[last])
        return fork

    def sample(self, logits: torch.Tensor, draws: Sequence[Draw]) -> list[Pick]:
        """One token per row, each from its request's own counter-based random stream."""
        return sample(logits, draws, self.ending)
