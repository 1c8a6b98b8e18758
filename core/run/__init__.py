"""What each command runs: :mod:`~ipuft.run.runtime` (from a config to a ready engine), :mod:`~ipuft.run.train`
(the training loop), :mod:`~ipuft.run.bench` (``ipuft bench``), :mod:`~ipuft.run.evaluate` (``ipuft eval``),
:mod:`~ipuft.run.generate` (``ipuft generate``) and the learning-rate :mod:`~ipuft.run.schedule`. ``ipuft
export`` is :func:`ipuft.io.hf_export.export_hf`; the click commands are in :mod:`ipuft.cli.commands`."""
