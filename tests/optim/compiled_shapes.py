"""The parameter shapes the tests give torchao's low-bit AdamW (``--optimizer adamw4bit | adamw_fp8``).

torchao compiles its step once per parameter shape (``torch.compile(..., dynamic=False)`` in torchao/optim/adam.py),
~5-9 s each with inductor on one CPU core, a cold cache. The unit tests (test_optim.py, test_skip_on_device.py) step
shapes of DiT-T/2's own parameters, with the same weight decay as test_optim.py's ``ditforge train`` runs of
DiT-T/2, so that the compiled steps serve them all in one process (and through inductor's cache on disk in another).
"""

# Two above the 4,096 elements torchao quantizes (multiples of its 128-element block), two below; in this order
# 5,000-element chunks (test_skip_on_device) take the first alone, the next two together, the last alone.
DIT_T2_SHAPES = [(576, 192), (192,), (192, 192), (8, 192)]
WEIGHT_DECAY = 0.1
