"""The portable core: everything an exported model and a Hugging Face user depend on.

Imports torch (and transformers, in the two files of the exported model) and
its own siblings only, never fairseq nor the rest of this package: every file
here travels with each model ``alibi-export-hf`` writes (``export.writer``
copies this folder) and is loaded there by transformers' remote-code loader,
which follows ``from .module import name`` (so this folder stays flat).

* ``errors``: the root of every user-fixable error;
* ``scaling``: the context-extension spec (``Scaling``) and its spellings;
* ``alibi``: ALiBi's slopes, what each extension method does to them, the one bias formula;
* ``bias``: a layer stack's shared bias object (slopes, scaling, caches);
* ``kernels`` (+ ``causal_blocks``, ``flex``): attention kernels in one registry;
* ``configuration_alibi``, ``modeling_alibi``: the exported Hugging Face model.
"""
