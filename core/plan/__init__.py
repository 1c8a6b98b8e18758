"""The cost model: what a step holds, moves and computes, predicted without running it.

- :mod:`~ipuft.plan.memory` declares what each phase of the step program holds on the device and what the
  host keeps (the engine's counters are held equal to it by the tests);
- :mod:`~ipuft.plan.measure` measures what one unit computes and what autograd saves, on fake tensors;
- :mod:`~ipuft.plan.flops` turns those measurements into a step's FLOPs and rates;
- :mod:`~ipuft.plan.estimate` puts them together into ``ipuft plan``'s figures (memory, traffic, FLOPs);
- :mod:`~ipuft.plan.fit` says whether they fit this machine, and what would make them fit.

The plan reads the rules the engine cuts its work by (:mod:`ipuft.engine.cuts`) and the model's parts
(:mod:`ipuft.engine.model`); the engine never imports the plan. Nothing is imported here, so that importing one
module does not import the others.
"""
