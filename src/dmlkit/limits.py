"""Upper bounds of count options shared by the command line, the configs and the library.

Bottom layer with no imports, so that the CLI's option declarations (``typer.Option(max=...)``,
read at start-up) and the typed configs (``Field(le=...)``) name the same number as the library
check. Without a bound a huge value (``--threads 1e23``) ended in a traceback from torch or
numpy (an overflow, an allocation of exabytes), or ran for ever (``fewshot --episodes 1e23``);
with one, it is one ``error:`` line and exit 2. Each bound lies far above any real use.
"""

from __future__ import annotations

__all__ = ["MAX_BATCHES_PER_EPOCH", "MAX_BINS", "MAX_EPISODES", "MAX_RESAMPLES", "MAX_THREADS"]

#: torch CPU threads (``--threads``, ``threads`` of the tracking and patch configs,
#: ``torchrun.threads_per_process`` of a bench, ``$DMLKIT_NUM_THREADS``). A fixed number, not
#: this machine's core count, so that a config valid on one host is valid on every other.
MAX_THREADS = 1024
#: Bootstrap resamples of :func:`dmlkit.protocol.stats.paired_bootstrap` (1000 is the
#: default; 10^6 resamples hold 8 MB of means).
MAX_RESAMPLES = 10**6
#: Histogram bins of ``dmlkit plot histograms --bins`` and
#: :func:`dmlkit.metrics.pos_neg_histograms` (100 is the default).
MAX_BINS = 10**6
#: Few-shot episodes of ``dmlkit fewshot --episodes`` and
#: :class:`dmlkit.samplers.EpisodeSampler` (1000 is the default; 600 the usual paper count).
MAX_EPISODES = 10**7
#: Batches per epoch of :class:`dmlkit.samplers.MPerClassSampler` and the config's
#: ``sampler.batches_per_epoch`` (default: the dataset's size over the batch's; 10^19 raised
#: OverflowError at ``len()``, beyond a C ``ssize_t``). At 1 ms a batch, 11 days an epoch.
MAX_BATCHES_PER_EPOCH = 10**9
