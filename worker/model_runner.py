"""ModelRunner: owns this rank's model and turns a scheduler step into sampled tokens.

Runs inside the worker process of one TP rank (or in-process for the uni executor).
Every rank receives the same `SchedulerOutput`, runs the same forward pass (the
collectives line up), gets the same all-gathered logits and samples the same tokens;
only the output rank's result travels back to the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from model_loader import get_model
from models.layers.attention import AttentionMetadata
from models.layers.decode_context import TOTAL_BYTES as DECODE_CONTEXT_TOTAL_BYTES
from worker.kv_cache import KVCacheConfig, allocate_kv_cache
from worker.sampler import Sampler

if TYPE_CHECKING:
    from engine.outputs import ModelRunnerOutput, SchedulerOutput


class ModelRunner:
    def __init__(self, config: Any, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.model: nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.kv_cache_config: KVCacheConfig | None = None
        self.sampler = Sampler()
        # A serial number per live request (AttentionMetadata.seq_keys): a finished,
        # aborted or preempted request loses its number, so a reused id or a recomputed
        # sequence never matches K/V that a layer kept from before.
        self._seq_keys: dict[str, int] = {}
        self._next_seq_key = 0

    def load_model(self) -> None:
        self.model = get_model(self.config)

    def _require_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("load_model() must run before the model is used")
        return self.model

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """A dummy full-causal forward of `num_tokens` tokens plus logits for every
        sequence's last token: the largest activation footprint a step can have."""
        model = self._require_model()
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.config.model_config.max_model_len
        hidden = model(input_ids, positions)
        num_seqs = min(self.config.scheduler_config.max_num_seqs, num_tokens)
        model.compute_logits(hidden[-num_seqs:])

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        model = self._require_model()
        self.kv_caches = allocate_kv_cache(kv_cache_config, self.device)
        layers = model.attention_layers()
        for attn, cache in zip(layers, self.kv_caches, strict=True):
            attn.kv_cache = cache
            attn.decode_context.max_bytes = DECODE_CONTEXT_TOTAL_BYTES // max(len(layers), 1)
        self.kv_cache_config = kv_cache_config

    def _prepare_inputs(self, scheduler_output: "SchedulerOutput") -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        assert self.kv_cache_config is not None
        block_size = self.kv_cache_config.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        for req in scheduler_output.scheduled:
            n = len(req.token_ids)
            input_ids.extend(req.token_ids)
            for pos in range(req.start_pos, req.start_pos + n):
                positions.append(pos)
                slots.append(req.block_ids[pos // block_size] * block_size + pos % block_size)
            seq_lens.append(req.start_pos + n)
            query_start_loc.append(query_start_loc[-1] + n)
        max_blocks = max(len(r.block_ids) for r in scheduler_output.scheduled)
        block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.long)
        for i, req in enumerate(scheduler_output.scheduled):
            block_tables[i, : len(req.block_ids)] = torch.tensor(req.block_ids, dtype=torch.long)
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            block_tables=block_tables.to(self.device),
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            block_size=block_size,
            seq_keys=self._update_seq_keys(scheduler_output),
        )
        # The last token of each chunk that samples is where its logits come from.
        sample_rows = [query_start_loc[i + 1] - 1 for i, r in enumerate(scheduler_output.scheduled) if r.sample]
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos_t, md, sample_rows

    def _update_seq_keys(self, scheduler_output: "SchedulerOutput") -> tuple[int, ...]:
        for req_id in scheduler_output.finished_req_ids:
            self._seq_keys.pop(req_id, None)
        if not self._seq_keys:  # nothing from before is still running
            for attn in self._require_model().attention_layers():
                attn.decode_context.release()
        keys = []
        for req in scheduler_output.scheduled:
            key = self._seq_keys.get(req.req_id)
            if key is None:
                key = self._seq_keys[req.req_id] = self._next_seq_key
                self._next_seq_key += 1
            keys.append(key)
        return tuple(keys)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: "SchedulerOutput") -> "ModelRunnerOutput":
        from engine.outputs import ModelRunnerOutput

        model = self._require_model()
        if not scheduler_output.scheduled:
            return ModelRunnerOutput([], [], [])
        input_ids, positions, md, sample_rows = self._prepare_inputs(scheduler_output)
        hidden = model(input_ids, positions, md)
        sampled_reqs = [r for r in scheduler_output.scheduled if r.sample]
        if not sampled_reqs:
            return ModelRunnerOutput([], [], [])
        logits = model.compute_logits(hidden[sample_rows]).float().cpu()
        tokens, logprobs = self.sampler(logits, sampled_reqs, self.config.seed)
        return ModelRunnerOutput([r.req_id for r in sampled_reqs], tokens, logprobs)


# vLLM's name, for users who look for it.
GPUModelRunner = ModelRunner
