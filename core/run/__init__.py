"""What each command runs: :mod:`~ipuft.run.runtime` (from a config to a ready engine), :mod:`~ipuft.run.train`
(the training loop), :mod:`~ipuft.run.bench` (``ipuft bench``), :mod:`~ipuft.run.evaluate` (``ipuft eval``),
:mod:`~ipuft.run.generate` (``ipuft generate``), :mod:`~ipuft.run.export` (``ipuft export``), the layout
``auto`` resolves to (:mod:`~ipuft.run.layout`) and the learning-rate :mod:`~ipuft.run.schedule`; the click
commands are in :mod:`ipuft.cli.commands`."""
