"""Sample-quality metrics: FID, sFID, Inception Score and precision / recall (``fid``), the built-in digits
feature extractor (``digits``), FVD of videos from a local I3D (``fvd``), the CLIP score (``clip_score``);
reading sample and reference sets (``readers``); and ``ditforge eval``, the metrics of one against the other
(``evaluate``)."""
