"""Sharded data sets: WebDataset tar shards streamed in a world-size-independent order that resumes exactly.

Library: the shards are WebDataset tar files (``webdataset.TarWriter`` writes them; any WebDataset shard set
reads), chosen over megatron-energon because a tar shard is a plain POSIX tar that every web-scale pipeline
(img2dataset, video2dataset, LAION, DataComp) already emits, webdataset is a small pure-Python dependency, and
fsspec gives it every storage (``s3://``, ``gs://``, ``hf://``, ``http://``). webdataset's own loader reads a tar
front to back and shuffles through a buffer; ditforge needs a position it can save and restore at any world
size, so it reads members by their offsets instead (from the tar headers, through stdlib ``tarfile``, over an
mmap of the local file) and orders them as below. See docs/data.md for the how-to.

A shard holds samples of members ``<key>.<field>``:

- latent shards (``ditforge extract-features --format wds``): ``latent.npy`` (C, [T,] h, w) float16/32, the
  scaled latent posterior's mean (the pixels in pixel space); ``std.npy`` its std (a real VAE only);
  ``cls`` the class label; text condition: ``text.npy`` (L_i, D_text), the caption's states trimmed to its
  L_i real tokens (the mask is implied: True on the first L_i of ``text_max_length``), and ``txt`` the caption;
- raw shards (``ditforge shard``): the image file's bytes as read from disk (``jpg``, ``png``, ``webp``, ...,
  never re-encoded), ``cls`` and/or ``txt``.

Beside the shards, ``shards.json`` (written last, atomically) records the kind, the per-shard sample counts
and, for latents, what ``features.json`` records (VAE, text encoder, shapes, scale); shards without it (foreign
WebDataset shards of images with ``txt`` / ``cls``) are indexed by a scan of their headers at start.

Order. K virtual streams (``--data_streams``, fixed for a run). For each data set and epoch e, a permutation of
its shards (seed ``derive_seed(seed, set, e)``) is dealt to the streams round-robin; with fewer shards than K,
each shard is first cut into ``ceil(K / shards)`` member ranges, so every sample of an epoch belongs to exactly
one stream. A stream reads its pieces in windows of ``--shuffle_shards`` S pieces and yields a full random
permutation of each window's samples (seed ``derive_seed(seed, set, e, stream, window)``): the shuffle is
uniform within a window of S shards, and windows follow the epoch's random shard order. Every set cycles its
epochs on its own (an infinite stream). A blend picks the set of stream position p by a counter-based draw
(uniform ``derive_seed(seed, BLEND, stream, p // 4096)`` block, element ``p % 4096``) against the cumulative
weights. The global batch is b = B / K consecutive samples of every stream, streams in order 0..K-1.

Ranks and workers. Rank r of W owns the contiguous streams ``[r K/W, (r+1) K/W)`` and its data-loader worker w
of n the contiguous sub-block ``w``; so the global batch holds the same samples *in the same order* at every
world size and worker count (a deviation from dealing streams ``s % W == r``: contiguous blocks keep the
order, and with it every per-row random number of ``step_randomness``). Each loader batch carries its streams'
positions after it; ``ShardLoader`` keeps those of the batches the trainer consumed, and the checkpoint stores
all K (``meta.json``'s ``loader``), so a resume at any W and n that divide K continues exactly.

Bad data never stops the run: a member that fails to decode is skipped (the stream takes its next sample, so
the skip is a function of the file), counted in the stream's state and recorded in ``RUN/bad_samples.jsonl``
as ``{"path": "<shard>#<key>", "error"}``; a shard that cannot be opened or is truncated is retried
``--shard_retries`` times (backoff 0.1 s, doubling), then the members before the damage are used and the rest
skipped, and the shard is recorded.
"""
