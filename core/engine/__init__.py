"""The engine: what runs a step and what it costs.

- :mod:`~ipuft.engine.model` assembles the components, their shard specs and the step program;
- :mod:`~ipuft.engine.stored` keeps the model in the :mod:`~ipuft.engine.store` of variables, each in its
  :mod:`~ipuft.engine.placement` (:class:`~ipuft.engine.stored.StoredModel`, with its checkpoints' full views);
- :mod:`~ipuft.engine.phased` is the schedule: it runs the program phase by phase
  (:class:`~ipuft.engine.phased.PhasedEngine`); :mod:`~ipuft.engine.compute` runs a unit's forward and backward
  over the micro-batches and the :mod:`~ipuft.engine.activations` buffers, :mod:`~ipuft.engine.gradients` sums
  their gradients, :mod:`~ipuft.engine.update` updates a unit in pieces, with the
  :mod:`~ipuft.engine.precision` recipes and the :mod:`~ipuft.engine.scaling` of the loss;
  :mod:`~ipuft.engine.inference` runs forward passes of a stored model for eval and generate;
- :mod:`~ipuft.engine.memory` declares what each phase holds, :mod:`~ipuft.engine.plan` predicts a step's
  memory and traffic and :mod:`~ipuft.engine.fit` whether it fits this machine; :mod:`~ipuft.engine.measure`
  and :mod:`~ipuft.engine.flops` what a unit computes and holds, :mod:`~ipuft.engine.profiling` where its time
  goes, :mod:`~ipuft.engine.kernels` whether this machine computes the precision fast, and
  :mod:`~ipuft.engine.hostmem` how the process keeps host memory.

Nothing is imported here, so that importing one of them (the console script imports ``hostmem`` before
torch) does not import the others.
"""
