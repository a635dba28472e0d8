"""The portable core: everything an exported model and a Hugging Face user depend on.

Imports torch (and transformers, in the two files of the exported model) and
its own siblings only, never fairseq nor the rest of this package: every file
here travels with each model ``alibi-export-hf`` writes (``export.writer``
copies this folder) and is loaded there by transformers' remote-code loader,
which follows ``from .module import name`` (so this folder stays flat).

* ``errors``: the root of every user-fixable error;
* ``params``: how a position method declares its options (``Param``: default, valid range, role);
* ``scaling``: the context-extension spec (``Scaling``), its methods (``METHOD_TABLE``) and spellings;
* ``positions``: the registry of position methods (``POSITIONS``): each one's kind, parameters,
  the extension methods that apply to it and its builder;
* ``methods``: the modules of position methods registered outside this folder that an exported
  model imports (empty here; ``alibi-export-hf`` writes it anew beside such a method's module);
* ``alibi``: ALiBi's slopes, what each extension method does to them, the one bias formula;
* ``rotary``: RoPE (rotation of queries and keys) with its extension methods (PI, NTK, YaRN);
* ``t5bias``, ``kerple``, ``fire``: the learned biases (T5's buckets, Kerple's log kernel, FIRE's MLP);
* ``fox``: the Forgetting Transformer's per-layer forget gates (a data-dependent bias ``c_i - c_j``);
* ``hybrid``: RNoPE-SWA, RoPE layers with a sliding window interleaved with full-attention NoPE layers;
* ``stickbreaking``, ``path``: methods that compute their attention themselves (stick-breaking
  attention, no softmax; PaTH, keys through a product of Householder-like transformations),
  each with its own kernel and KV cache;
* ``native``: fused CPU calls in C++, compiled on first use where a compiler and AVX2 are (stick-breaking's
  and FIRE's evaluation), eager PyTorch elsewhere;
* ``logit_scale``, ``ssmax``: query scaling by the keys seen (the ``logn`` extension method; learned SSMax);
* ``bias``: a layer stack's shared position object (``StackBias``: slopes or a learned bias,
  scaling, caches; the causal mask alone for NoPE);
* ``kernels`` (+ ``causal_blocks``, ``flex``): attention kernels in one registry;
* ``layer``: one layer's wiring to its stack's object and its attention call (fairseq's layer and the
  exported model's);
* ``configuration_alibi``, ``modeling_alibi``: the exported Hugging Face model.

Every module of this folder is named above (tests/test_docs.py checks it).
"""
