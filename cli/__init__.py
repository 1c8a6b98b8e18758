"""The ``ipuft`` command line (click)."""
