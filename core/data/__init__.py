"""What a step trains on: one step's :mod:`~ipuft.data.batch`, the :mod:`~ipuft.data.synthetic` sample data, rows
read from local :mod:`~ipuft.data.files`, the :mod:`~ipuft.data.tokenizer`, prompt :mod:`~ipuft.data.templates`,
conversations and their :mod:`~ipuft.data.chat` templates, and the tokenized datasets (:mod:`~ipuft.data.tokens`,
laid out by :mod:`~ipuft.data.builder`) with their :mod:`~ipuft.data.cache`."""
