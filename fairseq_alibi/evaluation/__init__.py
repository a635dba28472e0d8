"""Tools over trained models: one runner (``runner``) for every measure
(``perplexity``: ``alibi-sweep``; ``retrieval``: ``alibi-retrieval``) over every
backend (``backends``: fairseq checkpoints; ``hf_backend``: Hugging Face models),
with built-in prompts (``prompts``), prompt files (``task_files``) and reports
(``report``)."""
