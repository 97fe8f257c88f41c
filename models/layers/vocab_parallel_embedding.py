"""Vocabulary-parallel embedding and LM head.

The vocabulary is padded to a multiple of 64 (and of tp_size) and split into equal
contiguous ranges, one per rank. Padding rows are zero and never read: token ids fall
in [0, vocab_size), and `compute_logits` drops the padded columns.

A quantisation config whose `get_embedding_method(role)` answers (GGUF's; role "embed_tokens"
or "lm_head") may hold the table in its own format: the method registers it (`qweight`
instead of `weight`, this rank's rows, loaded by the same `weight_loader`), looks rows
up (`embedding`) and computes the LM head's logits (`apply`) from it. Others leave the
table plain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from distributed.utils import cdiv
from models.errors import WeightLoadError
from models.layers import cpu_ops
from models.layers.build_config import get_layer_build_config
from models.layers.quantization import LinearMethodBase
from models.layers.weight_utils import load_whole, set_weight_attrs

DEFAULT_VOCAB_PADDING_SIZE = 64
_FLOAT32_EXACT_IDS = 1 << 24  # every integer up to this is a float32


def pad_vocab_size(vocab_size: int, multiple: int) -> int:
    return cdiv(vocab_size, multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r*n, (r+1)*n) of the padded table; lookups outside that range
    contribute zeros and the all-reduce fills them in from the owning rank. With
    `reduce_results=False` the lookup returns this rank's part and the caller sums it
    (the first RMSNorm's `all_reduce_input`, as after a RowParallelLinear)."""

    role = "embed_tokens"  # what a quantisation config's get_embedding_method is asked for

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
                 reduce_results: bool = True) -> None:
        super().__init__()
        self.reduce_results = reduce_results
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        padded = pad_vocab_size(num_embeddings, padding_size)
        self.num_embeddings_padded = pad_vocab_size(padded, self.tp_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.params_dtype = torch.get_default_dtype()
        quant_config = get_layer_build_config().quant_config
        self.embedding_method = quant_config.get_embedding_method(self.role) if quant_config is not None else None
        if self.embedding_method is not None:
            self.embedding_method.create_weights(self, self.num_embeddings_per_partition, embedding_dim,
                                                 self.weight_loader)
        else:
            self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim),
                                       requires_grad=False)
            set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """This rank's rows of the table (the plain `weight`, or a method's row-major
        table: its second dim is the method's row width), padding rows zeroed."""
        if tuple(loaded_weight.shape) != (self.num_embeddings, param.shape[1]):
            raise WeightLoadError(
                f"shape mismatch (vocab embedding): the model expects {(self.num_embeddings, param.shape[1])}, "
                f"the checkpoint tensor has {tuple(loaded_weight.shape)}"
            )
        start = min(self.vocab_start_index, self.num_embeddings)
        end = min(self.vocab_end_index, self.num_embeddings)
        if end - start == param.shape[0]:  # no padding rows on this rank
            load_whole(param, loaded_weight[start:end])
            return
        param.data[: end - start].copy_(loaded_weight[start:end])
        param.data[end - start :].zero_()

    def _lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        if self.embedding_method is None:
            return F.embedding(local_ids, self.weight)
        return self.embedding_method.embedding(self, local_ids).to(self.params_dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        in_range = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index) * in_range
        out = self._lookup(local_ids)
        out = out * in_range.unsqueeze(-1).to(out.dtype)
        return tensor_model_parallel_all_reduce(out) if self.reduce_results else out


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, sharded like the embedding. Tie it by passing the
    embedding: the two then share one Parameter, and one checkpoint tensor fills both.

    The product goes through the platform's unquantised linear method (quantised linear
    methods leave the LM head alone), so on the CPU it gets the same packed small-batch
    path as the linear layers; a table held by an embedding method (GGUF's blocks, its
    own or the tied embedding's) is multiplied by that method's `apply`.

    `logits_soft_cap` c (Gemma's `final_logit_softcapping`) turns each logit z into
    c * tanh(z / c), in both `compute_logits` and `compute_greedy_tokens`: tanh is
    monotonic, but it can round two logits to one value, and the logprobs change."""

    role = "lm_head"

    def __init__(self, num_embeddings: int, embedding_dim: int, tie_to: VocabParallelEmbedding | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim)
        if tie_to is not None:  # one table, the embedding's, in whatever form it holds it
            for name in [n for n, _ in self.named_parameters(recurse=False)]:
                delattr(self, name)
            self.embedding_method = tie_to.embedding_method
            for name, param in tie_to.named_parameters(recurse=False):
                setattr(self, name, param)
        self.logits_soft_cap = logits_soft_cap
        self.quant_method: LinearMethodBase = (self.embedding_method if self.embedding_method is not None
                                               else get_layer_build_config().unquantized_linear_method())

    def _apply_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """This rank's [tokens, vocab / tp_size] slice of the (soft-capped) logits."""
        logits = self.quant_method.apply(self, hidden_states)
        if self.logits_soft_cap:
            # transformers' order of operations: divide, tanh, multiply.
            logits = torch.tanh(logits / self.logits_soft_cap).mul_(self.logits_soft_cap)
        return logits

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[tokens, vocab] logits, identical on every rank (all-gathered)."""
        logits = tensor_model_parallel_all_gather(self._apply_logits(hidden_states), dim=-1)
        return logits[..., : self.num_embeddings]

    def compute_greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The argmax token of each row's logits, [tokens] int64, identical on every rank:
        `compute_logits(h).max(-1).indices` (the first maximum on ties) without gathering
        the logits. Each rank takes the maximum of its own vocabulary range and the ranks
        exchange one (value, token id) pair per row, 8 bytes where the logits are
        vocab * 4 / tp_size (a 4 MB all-gather at 32 rows of a 32k vocabulary, TP=2);
        ranks hold ascending ranges, so the lowest rank with the maximum holds the first
        one. A collective: every rank calls it with the same number of rows."""
        if self.tp_size > 1 and self.num_embeddings_padded > _FLOAT32_EXACT_IDS:
            return self.compute_logits(hidden_states).float().max(dim=-1).indices
        logits = self._apply_logits(hidden_states)
        valid = min(self.num_embeddings - self.vocab_start_index, logits.shape[-1])  # the rest is padding
        if valid > 0:
            values, ids = _first_max(logits, valid)
        else:  # a rank whose whole range is padding (a tiny vocabulary at a large TP)
            values = logits.new_full(logits.shape[:-1], float("-inf"))
            ids = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
        if self.tp_size == 1:
            return ids
        # Token ids travel as float32, exact below _FLOAT32_EXACT_IDS (checked above).
        pairs = torch.stack([values, (ids + self.vocab_start_index).float()], dim=-1)
        gathered = tensor_model_parallel_all_gather(pairs.unsqueeze(0), dim=0)  # [tp_size, tokens, 2]
        best_rank = gathered[..., 0].max(dim=0).indices
        return gathered[..., 1].gather(0, best_rank.unsqueeze(0)).squeeze(0).long()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding lookup; call compute_logits()")


def _first_max(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's maximum over its first `n` logits, as float32, and the index of its
    first occurrence: one C pass on the CPU where the kernel takes the tensor
    (`cpu_ops.py`), else torch's max, which gives the same values and indices."""
    kernel = cpu_ops.load() if logits.device.type == "cpu" else None
    found = kernel.argmax_rows(logits, n) if kernel is not None else None
    return found if found is not None else logits[..., :n].float().max(dim=-1)
