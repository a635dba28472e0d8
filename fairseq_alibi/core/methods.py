"""The position methods registered outside this folder that an exported model computes.

Empty here: such a method's module (its maths and its ``register(Position(...))``
call) is loaded by its plugin with ``positions.load_module``, as a module of this
folder.  In an exported model's directory, ``alibi-export-hf`` copies that module
beside these files and writes this file anew with one relative import of it
(``export/writer.py``): importing this file registers the method there before
``configuration_alibi`` reads the registry, and transformers' remote-code loader
copies the module because this file imports it (``from .name import``).
"""

#: The methods whose modules this file imports.
REGISTERED: tuple = ()
