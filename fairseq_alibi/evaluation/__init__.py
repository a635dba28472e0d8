"""Tools over trained models: the length x method grid (``grid``), perplexity
(``perplexity``, the ``alibi-sweep`` command) and reports (``report``)."""
