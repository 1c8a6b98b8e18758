"""The engine: what runs a step and what it costs.

- :mod:`~ipuft.engine.model` assembles the components, their shard specs and the step program;
- :mod:`~ipuft.engine.phased` runs the program phase by phase (:class:`~ipuft.engine.phased.PhasedEngine`),
  over the :mod:`~ipuft.engine.store` of variables, the :mod:`~ipuft.engine.activations` buffers and each
  variable's :mod:`~ipuft.engine.placement`, with the :mod:`~ipuft.engine.precision` recipes and the
  :mod:`~ipuft.engine.scaling` of the loss; :mod:`~ipuft.engine.inference` runs forward passes for eval and
  generate the same way;
- :mod:`~ipuft.engine.plan` predicts its memory and traffic, :mod:`~ipuft.engine.measure` and
  :mod:`~ipuft.engine.flops` what a unit computes and holds, :mod:`~ipuft.engine.profiling` where its time
  goes, :mod:`~ipuft.engine.kernels` whether this machine computes the precision fast, and
  :mod:`~ipuft.engine.hostmem` how the process keeps host memory.

Nothing is imported here, so that importing one of them (the console script imports ``hostmem`` before
torch) does not import the others.
"""
