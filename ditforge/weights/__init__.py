"""Weights that training, sampling and export all read: checkpoint folders and weight files (``read.py``), LoRA
adapters added, merged and saved (``lora.py``), and a run's model rebuilt from its ``--init_from`` and checkpoint
(``finetuned.py``). Nothing here writes a checkpoint (``ditforge.train.checkpoint``) or imports ``train``."""
