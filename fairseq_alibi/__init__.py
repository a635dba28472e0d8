"""fairseq-alibi: ALiBi models for fairseq, loaded as a plugin.

Importing this package changes nothing and imports neither fairseq nor
transformers: ``fairseq_alibi.models`` registers the models with fairseq and
applies the fairseq/torch/NumPy changes of ``patches/`` (what
``fairseq-train --user-dir "$(alibi-user-dir)"`` and the ``alibi-*`` console
scripts load); ``fairseq_alibi.hf`` serves Hugging Face models without fairseq.
"""

__version__ = "0.1.0"
