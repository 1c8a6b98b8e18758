"""The engine: what runs a step.

- :mod:`~ipuft.engine.model` assembles the components, their shard specs and the step program;
- :mod:`~ipuft.engine.stored` keeps the model in the :mod:`~ipuft.engine.store` of variables, each in its
  :mod:`~ipuft.engine.placement` (:class:`~ipuft.engine.stored.StoredModel`, with its checkpoints' full views);
- :mod:`~ipuft.engine.phased` is the schedule: it runs the program phase by phase
  (:class:`~ipuft.engine.phased.PhasedEngine`); :mod:`~ipuft.engine.compute` runs a unit's forward and backward
  over the micro-batches and the :mod:`~ipuft.engine.activations` buffers, :mod:`~ipuft.engine.gradients` sums
  their gradients, :mod:`~ipuft.engine.update` updates a unit in pieces, with the
  :mod:`~ipuft.precision` recipes and the :mod:`~ipuft.engine.scaling` of the loss;
  :mod:`~ipuft.engine.inference` runs forward passes of a stored model for eval and generate;
- :mod:`~ipuft.engine.cuts` holds the rules the engine cuts its work by (update groups and calls, streamed
  pieces, gradient takes, activation sizes), which the cost model (:mod:`ipuft.plan`) counts by;
  :mod:`~ipuft.kernels` says whether this machine computes the precision fast.

The engine never imports :mod:`ipuft.plan`: what a step costs is predicted apart from what runs it.
Nothing is imported here, so that importing one of them does not import the others.
"""
