"""Online miners: choose informative pairs or triplets inside a batch.

A miner looks at a batch of embeddings and labels and returns *indices* that a loss then uses
(``loss(embeddings, labels, indices=miner(embeddings, labels))``). Two output types:

* ``"pair"``: ``(a1, p, a2, n)`` - positive pairs ``(a1[i], p[i])`` and negative pairs
  ``(a2[j], n[j])``;
* ``"triplet"``: ``(a, p, n)`` - ``label[a] == ref_label[p] != ref_label[n]``.

Anchors (``a``, ``a1``, ``a2``) index ``embeddings``; positives and negatives index the
*reference set*, which is ``ref_emb`` when given (e.g. a cross-batch memory) and ``embeddings``
itself otherwise. When the reference set is the batch itself, an anchor is never its own
positive. Pairs are *ordered*: with the batch as its own reference both ``(i, j)`` and
``(j, i)`` appear, as in pytorch-metric-learning.

Everything runs on the embeddings' device with tensor operations only (no Python loop over
pairs or triplets, no transfer to numpy, the cost pointed out in seed 003), in ``O(B^2)``
memory for a ``B x B`` batch - except where the *output itself* is larger: the triplet miners
that return many negatives per positive pair (``batch_all``, ``all_triplets``,
``semi_hard(negatives="all")``) work through blocks of positive pairs, or read each pair's
negatives off its anchor's sorted row (see :class:`_BandTripletMiner`), so their extra memory is
``O(B^2 + number of triplets returned)``; no ``B x B x B`` tensor is ever built.

Available (config name -> class):

=====================  ======================================  ==================================
name                   class                                   source
=====================  ======================================  ==================================
``all_pairs``          :class:`AllPairsMiner`                  every positive and negative pair
``all_triplets``       :class:`AllTripletsMiner`               every valid triplet (small batches)
``batch_hard``         :class:`BatchHardMiner`                 Hermans et al. 2017
``semi_hard``          :class:`SemiHardMiner`                  Schroff et al. 2015 (FaceNet)
``batch_all``          :class:`BatchAllMiner`                  Hermans et al. 2017
``hard_negative_pairs`` :class:`HardNegativePairMiner`         seed 003 (HardNegativePairSelector)
``multi_similarity``   :class:`MultiSimilarityMiner`           Wang et al. 2019
``distance_weighted``  :class:`DistanceWeightedMiner`          Wu et al. 2017
=====================  ======================================  ==================================
"""

from dmlkit.losses._pairs import label_masks  # the one label-mask helper of losses and miners
from dmlkit.miners.base import (
    MINERS,
    AllPairsMiner,
    BaseMiner,
    get_miner,
    pairs_from_triplets,
    register_miner,
    triplets_from_pairs,
)
from dmlkit.miners.pair_miners import (
    DistanceWeightedMiner,
    HardNegativePairMiner,
    MultiSimilarityMiner,
)
from dmlkit.miners.triplet_miners import (
    AllTripletsMiner,
    BatchAllMiner,
    BatchHardMiner,
    SemiHardMiner,
)

__all__ = [
    "MINERS",
    "AllPairsMiner",
    "AllTripletsMiner",
    "BaseMiner",
    "BatchAllMiner",
    "BatchHardMiner",
    "DistanceWeightedMiner",
    "HardNegativePairMiner",
    "MultiSimilarityMiner",
    "SemiHardMiner",
    "get_miner",
    "label_masks",
    "pairs_from_triplets",
    "register_miner",
    "triplets_from_pairs",
]
