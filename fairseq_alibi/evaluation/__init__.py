"""Tools over trained models: one runner (``runner``: the grid; ``axes``: models,
methods, lengths; ``store``: the output directory and ``results.json``;
``progress``: what a run shows) for every measure (``perplexity``:
``alibi-sweep``; ``retrieval``: ``alibi-retrieval``) over every backend
(``backends``: fairseq checkpoints; ``hf_backend``: Hugging Face models), with
built-in prompts (``prompts``), prompt files (``task_files``) and reports
(``report``, ``intervals``, ``paired``)."""
