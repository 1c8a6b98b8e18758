"""Checkpoints and Hugging Face directories: ipuft's layout-free checkpoints (:mod:`~ipuft.io.checkpoint`), the
safetensors files they and exports are written as, a tensor at a time (:mod:`~ipuft.io.safetensors`), and
Hugging Face names (:mod:`~ipuft.io.hf_names`), import (:mod:`~ipuft.io.hf_import`) and export
(:mod:`~ipuft.io.hf_export`). Every file read here is untrusted, and every small one is read through
:mod:`~ipuft.io.files`, the one bounded reader that takes regular files only."""
