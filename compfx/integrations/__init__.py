"""compfx inside the training stacks users already run.

* :mod:`compfx.integrations.distributed`: ``torch.distributed`` (``torchrun``,
  DDP): the names of the synchronised evaluator and the rank-agreement /
  per-device strategies the search uses when a process group is initialised
  (they are the search's: :mod:`compfx.search.distributed`).
* :mod:`compfx.integrations.transformers` / :mod:`compfx.integrations.lightning`:
  ``CompfxCallback`` for Hugging Face's and Lightning's ``Trainer`` (optional
  extras), and Lightning's ``CompfxPrecision`` plugin;
  :mod:`compfx.integrations.accelerate`: ``CompfxAccelerate``, a plan applied
  before ``accelerator.prepare``; :mod:`compfx.integrations.planned_training`
  is what they share.

The ``torch.compile`` integration is the backend, :mod:`compfx.compile_backend`.
"""
