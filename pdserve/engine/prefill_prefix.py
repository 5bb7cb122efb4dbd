"""Prefill's own prefix cache: a prompt is computed from the end of the longest prefix whose KV
this prefill computed before.

Decode's prefix cache saves the handoff of a shared prefix, not its compute: prefill still had to
run the whole prompt to reach the tokens after it. So prefill keeps a paged pool of its own, with
the same BlockPool and hash chain as decode's, and computes a batch as prompt chunks that start
after each prompt's cached prefix (the chunked-prefill view of PagedCache, as decode runs the
prompts it prefills itself). Each prompt's KV is written to the pool as it is computed, and its
full blocks stay cached when the batch ends, least recently used evicted first.

What decode lacks (`send_from`, its first position not already held) and what this cache holds
can differ either way: positions before this cache's prefix are read back from the pool,
positions after it are cut from the layer's new K and V.
"""

from dataclasses import dataclass

import torch

from pdserve.core.block_pool import BlockPool, BlockTable, PoolExhausted
from pdserve.core.config import ModelConfig
from pdserve.engine.model_runner import ModelRunner, PromptPiece
from pdserve.engine.paged_cache import DecodeStepKv, PagedCache
from pdserve.models.protocol import CausalLM, LayerKvCallback


@dataclass
class CachedPrompt:
    """One prompt of a batch: its tokens, its table, and the KV positions it hands out."""

    prompt: tuple[int, ...]
    table: BlockTable
    send_from: int  # on_layer gets K and V of positions [send_from, prompt length)
    on_layer: LayerKvCallback

    @property
    def start(self) -> int:
        """The first position computed: the cached prefix ends here."""
        return self.table.cached_tokens


class PrefixCachedPrefill:
    def __init__(self, model: CausalLM, config: ModelConfig, tokens: int, block_size: int) -> None:
        blocks = tokens // block_size
        self.pool = BlockPool(blocks, block_size, prefix_cache=True)
        self.cache = PagedCache(config, blocks, block_size)
        self.runner = ModelRunner(model, self.cache, frozenset())  # it never samples

    def reserve(self, prompt: tuple[int, ...], salt: bytes = b"") -> BlockTable | None:
        """Room for the prompt, starting with its longest prefix cached under `salt`; None when
        the pool cannot hold it beside the prompts already reserved."""
        try:
            return self.pool.reserve(len(prompt), prompt, reuse=True, salt=salt)
        except PoolExhausted:
            return None

    def run(self, prompts: list[CachedPrompt]) -> torch.Tensor:
        """Computes every prompt after its cached prefix, in one pass; float32 logits of each
        prompt's last position. The tables are released, their full blocks left cached."""
        try:
            logits = self._forward(prompts)
            for p in prompts:
                p.table.prompt_written = True
        finally:
            for p in prompts:  # unwritten KV (a failed pass) is never cached
                p.table.release()
        return logits

    def _forward(self, prompts: list[CachedPrompt]) -> torch.Tensor:
        pieces = [PromptPiece(p.table, p.prompt, p.start, len(p.prompt)) for p in prompts]
        return self.runner.run([], pieces, lambda view: _ForwardingView(view, self.cache, prompts))


class _ForwardingView:
    """The pool's view for one prefill pass (pdserve.models.protocol.PagedKv) that also hands each
    prompt's K and V to its callback, layer by layer, before attending."""

    def __init__(self, view: DecodeStepKv, cache: PagedCache, prompts: list[CachedPrompt]) -> None:
        self._view, self._cache, self._prompts = view, cache, prompts
        # The cached positions each prompt must hand out too (where decode holds less than this
        # cache): the same slots in every layer.
        self._read_back = [
            torch.tensor(p.table.slots(p.send_from, p.start), dtype=torch.long)
            if p.send_from < p.start
            else None
            for p in prompts
        ]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        row = 0
        for p, slots in zip(self._prompts, self._read_back, strict=True):
            computed = slice(row, row + len(p.prompt) - p.start)
            row = computed.stop
            new_k, new_v = k[computed], v[computed]
            if slots is None:
                skip = p.send_from - p.start
                p.on_layer(layer, new_k[skip:], new_v[skip:])
            else:
                p.on_layer(
                    layer,
                    torch.cat([self._pooled(layer, 0, slots), new_k]),
                    torch.cat([self._pooled(layer, 1, slots), new_v]),
                )
        return self._view.attend(layer, q, k, v)

    def _pooled(self, layer: int, kv: int, slots: torch.Tensor) -> torch.Tensor:
        """[tokens, kv_heads, dim] of one layer's K (kv=0) or V (kv=1) at `slots`."""
        return self._cache.kv[layer, kv].index_select(1, slots).transpose(0, 1)
