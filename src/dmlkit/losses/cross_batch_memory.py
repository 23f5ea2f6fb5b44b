"""Cross-batch memory (XBM): past embeddings as extra references for any pair-based loss.

Wang, Zhang, Huang, Scott, "Cross-Batch Memory for Embedding Learning", CVPR 2020. Embeddings
drift slowly once training has warmed up, so the embeddings of the last few batches remain
valid references; a FIFO queue of them turns a batch of ``B`` into ``B x (B + M)`` pairs at the
cost of one ``(M, D)`` buffer.

Each call::

    ref = [batch (live, with gradient) ; queue (detached)]            (B + Q, D)
    indices = miner(batch, labels, ref, ref_labels)  or  all pairs     anchors: batch rows
    indices -= self pairs (anchor i with reference row i)
    loss = wrapped_loss(batch, labels, indices, ref_emb=ref, ref_labels=ref_labels)
    queue <- batch.detach()                                            (ring buffer, FIFO)

The current batch sits at rows ``[0, B)`` of the reference set, so an anchor's own row is
reference row ``i`` and is removed from the positives; indices a caller passes for the batch
alone are therefore valid reference indices too and are appended. Unlike
pytorch-metric-learning (which enqueues first and uses only the detached memory), the batch
part of the reference keeps its gradient, so in-batch pairs get the same gradient as without
memory and the queue adds ``B x Q`` detached pairs.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from dmlkit.exceptions import ConfigError, ShapeError
from dmlkit.losses.base import BaseLoss, ProxyLoss
from dmlkit.losses.combined import _NO_REFERENCES, CombinedLoss

__all__ = ["CrossBatchMemory"]


def _all_pairs(labels: torch.Tensor, ref_labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(a1, p, a2, n)``: every anchor-positive pair except ``(i, i)`` and every negative."""
    same = labels[:, None] == ref_labels[None, :]
    b = labels.shape[0]
    not_self = torch.ones_like(same)
    not_self[:, :b].fill_diagonal_(False)
    a1, p = torch.nonzero(same & not_self, as_tuple=True)
    a2, n = torch.nonzero(~same, as_tuple=True)
    return a1, p, a2, n


def _remove_self(indices: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Drop positive pairs / triplets whose positive is the anchor itself (reference row = anchor)."""
    if len(indices) == 4:
        a1, p, a2, n = indices
        keep = a1 != p
        return a1[keep], p[keep], a2, n
    if len(indices) == 3:
        a, p, n = indices
        keep = a != p
        return a[keep], p[keep], n[keep]
    raise ShapeError(
        f"a miner must return pairs (a1, p, a2, n) or triplets (a, p, n), got {len(indices)} tensors"
    )


class CrossBatchMemory(BaseLoss):
    """Wrap a pair/triplet-based loss with a FIFO memory of past embeddings (Wang et al. 2020).

    Args:
        loss: a dmlkit pair- or triplet-based loss that accepts a miner's indices
            (``loss.accepts_indices``) and ``ref_emb`` / ``ref_labels``.
        embedding_size: ``D``.
        memory_size: ``M``, the number of past embeddings kept (the paper uses a memory of
            about the size of the dataset for small datasets, e.g. a few thousand).
        miner: optional dmlkit miner, called as ``miner(batch, labels, ref_emb, ref_labels)``;
            without one every pair (but the self pairs) is used.

    ``forward(embeddings, labels, indices=None) -> scalar``. The queue (``embedding_memory``,
    ``label_memory``, ``queue_ptr``, ``queue_count``) is made of buffers, so ``state_dict()``
    saves it for checkpoint/resume; :meth:`reset_queue` empties it.

    Example::

        xbm = CrossBatchMemory(ContrastiveLoss(), embedding_size=128, memory_size=4096)
        loss = xbm(model(x), y)
    """

    accepts_indices = True

    def __init__(
        self,
        loss: BaseLoss,
        embedding_size: int,
        memory_size: int = 1024,
        miner: nn.Module | None = None,
    ) -> None:
        if not isinstance(loss, BaseLoss):
            raise ConfigError(f"CrossBatchMemory wraps a dmlkit loss, got {type(loss).__name__}")
        if isinstance(loss, ProxyLoss | CrossBatchMemory):
            raise ConfigError(
                f"CrossBatchMemory needs a pair-based loss; {type(loss).__name__} compares "
                "embeddings with its own proxies/weights, so a memory of embeddings does not apply"
            )
        if isinstance(loss, CombinedLoss):  # its terms would see neither memory nor indices' refs
            raise ConfigError(_NO_REFERENCES)
        if not getattr(loss, "accepts_indices", False):
            raise ConfigError(
                f"{type(loss).__name__} does not accept a miner's indices, so CrossBatchMemory "
                "cannot exclude each anchor's pair with itself: use a pair/triplet-based loss "
                "(contrastive, triplet, multi_similarity, ...)"
            )
        if embedding_size < 1 or memory_size < 1:
            raise ConfigError(
                f"embedding_size and memory_size must be positive, got {embedding_size}, {memory_size}"
            )
        super().__init__(loss.distance)
        self.loss = loss
        self.miner = miner
        # a dmlkit miner leaves each row's pair with its own copy among the references out
        # before mining (a self pair counted as a positive changed what it mines); any other
        # module is called plainly, and its self pairs are dropped after it (_remove_self)
        accepts = miner is not None and "ref_starts_with_batch" in inspect.signature(miner.forward).parameters
        self._miner_options = {"ref_starts_with_batch": True} if accepts else {}
        self.embedding_size = int(embedding_size)
        self.memory_size = int(memory_size)
        self.register_buffer("embedding_memory", torch.zeros(self.memory_size, self.embedding_size))
        self.register_buffer("label_memory", torch.zeros(self.memory_size, dtype=torch.long))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("queue_count", torch.zeros((), dtype=torch.long))

    # -- queue ------------------------------------------------------------------------------
    def reset_queue(self) -> None:
        """Empty the memory."""
        self.embedding_memory.zero_()
        self.label_memory.zero_()
        self.queue_ptr.zero_()
        self.queue_count.zero_()

    @property
    def num_stored(self) -> int:
        """How many past embeddings the memory holds (at most ``memory_size``)."""
        return int(self.queue_count)

    def memory(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored ``(embeddings, labels)`` (oldest rows first is not guaranteed)."""
        n = self.num_stored
        return self.embedding_memory[:n], self.label_memory[:n]

    @torch.no_grad()
    def enqueue(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        """Write a batch into the ring buffer, overwriting the oldest entries."""
        if embeddings.shape[0] > self.memory_size:
            embeddings, labels = embeddings[-self.memory_size :], labels[-self.memory_size :]
        b = embeddings.shape[0]
        if b == 0:
            return
        rows = (
            int(self.queue_ptr) + torch.arange(b, device=self.label_memory.device)
        ) % self.memory_size
        self.embedding_memory[rows] = embeddings.detach().to(self.embedding_memory.dtype)
        self.label_memory[rows] = labels.to(self.label_memory.device, torch.long)
        self.queue_ptr.fill_((int(self.queue_ptr) + b) % self.memory_size)
        self.queue_count.fill_(min(self.memory_size, int(self.queue_count) + b))

    def _follow(self, embeddings: torch.Tensor) -> None:
        """Move the queue to the batch's device and widen it to its dtype where needed.

        The queue is stored in at least float32 (bf16/fp16 batches are upcast when stored,
        float64 batches upgrade it) and read back in the batch's dtype. The new buffers are
        made outside inference mode: made under it (a validation loss inside
        ``torch.inference_mode()``), they were inference tensors, and every later training
        call's in-place write into them raised "Inplace update to inference tensor".
        """
        store_dtype = torch.promote_types(self.embedding_memory.dtype, embeddings.dtype)
        if (
            self.embedding_memory.device == embeddings.device
            and self.embedding_memory.dtype == store_dtype
        ):
            return
        with torch.inference_mode(False):
            self.embedding_memory = self.embedding_memory.to(embeddings.device, store_dtype)
            self.label_memory = self.label_memory.to(embeddings.device)

    # -- loss ---------------------------------------------------------------------------------
    def forward(self, embeddings, labels, indices=None, ref_emb=None, ref_labels=None):
        if ref_emb is not None or ref_labels is not None:
            raise ConfigError("CrossBatchMemory builds the reference set itself: pass no ref_emb")
        if embeddings.dim() == 2 and embeddings.shape[1] != self.embedding_size:
            raise ShapeError(
                f"CrossBatchMemory was built for embedding_size={self.embedding_size}, got "
                f"embeddings of size {embeddings.shape[1]}"
            )
        return super().forward(embeddings, labels, indices)

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        self._follow(embeddings)
        labels = labels.to(torch.long)
        mem_emb, mem_labels = self.memory()
        ref_emb = torch.cat([embeddings, mem_emb.detach().to(embeddings.dtype)], dim=0)
        ref_labels = torch.cat([labels, mem_labels], dim=0)

        if self.miner is not None:
            mined = _remove_self(tuple(self.miner(embeddings, labels, ref_emb, ref_labels, **self._miner_options)))
        else:
            mined = _all_pairs(labels, ref_labels)
        if indices is not None:
            indices = tuple(indices)
            if len(indices) != len(mined):
                raise ShapeError(
                    f"indices passed to CrossBatchMemory have {len(indices)} tensors but its "
                    f"miner gives {len(mined)}: use the same kind (pairs or triplets)"
                )
            mined = tuple(torch.cat([m, i.to(m.device)]) for m, i in zip(mined, indices))

        loss = self.loss(embeddings, labels, mined, ref_emb=ref_emb, ref_labels=ref_labels)
        self.enqueue(embeddings, labels)
        return loss

    def extra_repr(self) -> str:
        return f"embedding_size={self.embedding_size}, memory_size={self.memory_size}"
