"""compfx inside the training stacks users already run.

* :mod:`compfx.integrations.distributed`: ``torch.distributed`` (``torchrun``,
  DDP): a synchronised evaluator and the rank-agreement / per-device strategies
  the search uses when a process group is initialised.

The ``torch.compile`` integration is the backend, :mod:`compfx.backend`.
"""
