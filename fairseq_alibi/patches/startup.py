"""How fairseq is imported: without the scikit-learn and SciPy it loads for
tasks this plugin never runs (1.3 s of every console script's start)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

#: What fairseq imports on import, by name, for tasks this plugin never runs
#: (sentence prediction, audio classification): loaded on first use instead.
DEFERRED_IMPORTS = {"sklearn.metrics": ("f1_score", "matthews_corrcoef"), "scipy.stats": ("pearsonr", "spearmanr")}


def _stand_in(full_name: str, names, stand_ins: dict) -> types.ModuleType:
    """A module whose attributes load the real ``full_name`` (and retire the stand-ins)."""
    def real():
        package = full_name.split(".")[0]
        retire({name: module for name, module in stand_ins.items() if name.split(".")[0] == package})
        return importlib.import_module(full_name)

    def any_name(name):
        if name.startswith("__"):  # inspect and pickle probe __file__, __spec__, ...: not a use
            raise AttributeError(name)
        return getattr(real(), name)

    def deferred(name):
        return lambda *args, **kwargs: getattr(real(), name)(*args, **kwargs)

    module = types.ModuleType(full_name, "stand-in while fairseq imports: every name loads the real module")
    module.__getattr__ = any_name
    for name in names:  # taken by ``from ... import name`` at fairseq's import: must not load yet
        setattr(module, name, deferred(name))
    return module


def deferred_metric_imports() -> None:
    """Import fairseq with stand-ins for :data:`DEFERRED_IMPORTS`: the real
    modules load when fairseq first uses one of their names.

    Kind: start-up.  Stock: ``import fairseq`` imports scikit-learn's metrics
    and SciPy's statistics (1.3 s).  Here they load on first use, and compute
    what they computed.  It must run before anything imports fairseq (it is the
    first patch :func:`fairseq_alibi.patches.apply` runs); once fairseq is
    imported it does nothing."""
    if "fairseq" in sys.modules:
        return  # a stock CLI with --user-dir: fairseq came first
    stand_ins = {}
    for full_name, names in DEFERRED_IMPORTS.items():
        package_name, child = full_name.split(".")
        if package_name in sys.modules or importlib.util.find_spec(package_name) is None:
            continue  # already real, or absent (fairseq's import then says so)
        package = types.ModuleType(package_name, "stand-in while fairseq imports")
        package.__path__ = []
        module = _stand_in(full_name, names, stand_ins)
        setattr(package, child, module)
        stand_ins.update({package_name: package, full_name: module})
    sys.modules.update(stand_ins)
    try:
        import fairseq  # noqa: F401
    except ImportError:  # something in fairseq needed more of these packages than the stand-ins have
        retire(stand_ins)
        import fairseq  # noqa: F401,F811  (the real packages, as without this patch)
    finally:
        retire(stand_ins)


def retire(stand_ins: dict) -> None:
    """Take the stand-ins out of ``sys.modules`` (the real modules load on the next import)."""
    for name, module in stand_ins.items():
        if sys.modules.get(name) is module:
            del sys.modules[name]
