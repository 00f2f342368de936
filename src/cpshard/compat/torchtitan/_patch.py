"""``patch()``: torchtitan's ``cp_shard`` and ``prepare_context_parallel_input`` accept cpshard's
balancer types; ``TitanPatch`` reports what it bound and undoes it; ``activate()`` switches it on for
the life of a process.

Where it binds (the *sites*): ``prepare_context_parallel_input`` in its code (the function object's
``__code__``, so that every reference to it runs cpshard's, the trainer's and the validator's taken
by name at their import, a script's, a closure's or a copy pickled by value alike), and ``cp_shard``
in torchtitan's ``context_parallel/api.py``, in the ``torchtitan.distributed.context_parallel``
package (where Flux imports it from) and in every loaded module that bound it by name. For
cpshard's types ``prepare_context_parallel_input`` shards the batch itself, passing
``extra_kwargs["positions"]`` to the balancer explicitly: nothing inspects a caller, so no wrapper of
either function can hide the documents. A plain ``cp_shard`` call (Flux's) gives none: each row is
one document, with a :class:`NoPositionsWarning`, unless it passes ``positions=``. Other balancer
types go to torchtitan's own code unchanged.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import types
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

from cpshard.base.errors import fail
from cpshard.compat._binding import IN_FORCE, Bindings, rebind
from cpshard.compat.torchtitan import _titan
from cpshard.compat.torchtitan._shard import KINDS, shard

__all__ = ["LOCK", "TRAMPOLINE", "WRAPS", "NoPositionsWarning", "TitanPatch", "activate", "active", "patch",
           "prepare_replacement", "process_patch", "replacement"]

logger = logging.getLogger("cpshard.compat.torchtitan")
LOCK = threading.RLock()
WRAPS = "__cpshard_wraps__"  # the attribute of the replacement that holds torchtitan's cp_shard
TRAMPOLINE = "__cpshard_prepare__"  # the global of torchtitan's api module that its swapped code calls
_PROCESS: list[TitanPatch | None] = [None]  # activate()'s


class TitanPatch(Bindings):
    """What :func:`patch` bound, and its undo (or leaving the ``with`` block).

    Attributes:
        bound: the sites (``module.cp_shard``, ``module.prepare_context_parallel_input``) where
            torchtitan now calls cpshard's.
        skipped: ``{site: reason}``: sites left alone (the package does not bind ``cp_shard``).
        kinds: the ``load_balancer_type`` names it adds (``"cpshard"``, ``"cpshard_zigzag"``).
        torchtitan_version: the installed torchtitan's.
        active: whether the bindings are in place (False after ``undo()``, and for a patch made while
            another holds them: it binds nothing).
        state: ``"in force"``, ``"partly in force"`` (undone, but a site another library wrapped still
            holds its wrapper over cpshard's: ``unrestored`` names it) or ``"off"``.
    """

    _framework = "torchtitan"
    _scope = ""  # every loaded module: a training script takes prepare_context_parallel_input by name too
    _lock = LOCK

    def __init__(self, version: str | None) -> None:
        super().__init__()
        self.torchtitan_version = version
        self.kinds = tuple(KINDS)
        self._pairs: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}  # name -> (torchtitan's, new)
        self._code: tuple[Any, Any] | None = None  # (prepare_context_parallel_input, its own __code__)

    def __repr__(self) -> str:
        return (f"TitanPatch(torchtitan {self.torchtitan_version}, {self.state}: {len(self.bound)} bound, "
                f"{len(self.skipped)} skipped{f', {len(self.unrestored)} unrestored' if self.unrestored else ''})")

    def original(self, name: str = "cp_shard") -> Callable[..., Any]:
        """torchtitan's own ``cp_shard`` (what ``undo()`` puts back), or with
        ``name="prepare_context_parallel_input"`` a function running torchtitan's own code of it (``undo()``
        gives the function itself its code back)."""
        if name not in self._pairs:
            fail("patch", repr(self), f"bound no {name}", "use the patch in force (cpshard.compat.torchtitan.active()) "
                 "and name cp_shard or prepare_context_parallel_input")
        return self._pairs[name][0]

    def _bind(self, module: ModuleType, name: str, new: Any) -> None:
        self._save(module, name, new)
        self.bound.append(f"{module.__name__}.{name}")

    def undo(self) -> None:
        """Put torchtitan's functions back at every site, and wherever a module imported while the patch
        was on took a replacement by name. A site where another library has
        since set its own object (a wrapper over cpshard's) is left as it is and named in
        :attr:`unrestored` and a WARNING: the patch is then ``"partly in force"``. A copy of
        ``prepare_context_parallel_input`` made while the patch was on (its swapped code, pickled by
        value) runs torchtitan's own function afterwards. A second call does nothing."""
        with LOCK:
            was = self.active and self._code is not None
            if was:  # its own code back first, then the global it called
                fn, code = self._code
                if fn.__code__ is _trampoline.__code__:
                    fn.__code__ = code
            super().undo()
            api = sys.modules.get(_titan.API)
            if was and api is not None and TRAMPOLINE not in vars(api):
                # a copy of the function made while patched (its code, pickled by value) runs torchtitan's own
                setattr(api, TRAMPOLINE, self._pairs["prepare_context_parallel_input"][0])

    def _taken(self) -> dict[int, tuple[Any, Any]]:
        return {id(new): (new, old) for name, (old, new) in self._pairs.items() if name == "cp_shard"}

    def _restored(self, taken: list[str]) -> None:
        done = len(self.bound) - len(self.unrestored)
        logger.info("cpshard.compat.torchtitan: restored torchtitan's functions at %d of %d sites%s%s", done,
                    len(self.bound), f" and {len(taken)} taken meanwhile" if taken else "",
                    f"; partly in force: {len(self.unrestored)} left behind another library's objects "
                    f"({', '.join(self.unrestored)})" if self.unrestored else "")


def active() -> TitanPatch | None:
    """The patch in force in this process (``state == "in force"``), else one undone but partly in force
    (``state == "partly in force"``: a site another library wrapped still holds its wrapper over
    cpshard's), else None."""
    return TitanPatch.in_force() or TitanPatch.partly()


def _no_positions(kind: str) -> None:
    warnings.warn(f"cpshard.compat.torchtitan: cp_shard(load_balancer_type={kind!r}) was given no positions, so each "
                  "batch row is taken as one document (the fallback: balanced as one sequence a row, whatever it "
                  "packs). torchtitan's prepare_context_parallel_input passes them itself; a call of cp_shard that "
                  "shards rows of several documents should pass positions= (the batch's position ids)",
                  NoPositionsWarning, stacklevel=3)


class NoPositionsWarning(UserWarning):
    """A cpshard balancer ran without the batch's positions: each batch row was taken as one document."""


def replacement(original: Callable[..., Any]) -> Callable[..., Any]:
    """torchtitan's ``cp_shard`` with cpshard's balancer types added (:mod:`._shard`); ``positions=``
    (keyword only) names the batch's position ids (without them each row is one document, with a
    :class:`NoPositionsWarning`: Flux's plain calls, or a wrapper of ``prepare_context_parallel_input``
    bound before the patch that calls torchtitan's own)."""

    @functools.wraps(original)
    def cp_shard(cp_mesh: Any, inputs: tuple[Any, ...], attention_masks: Any, load_balancer_type: str | None =
                 "headtail", input_seq_dim: int = 1, ptrr_mask_key: str | None = None, *,
                 positions: Any = None) -> tuple[tuple[Any, ...], Any]:
        if load_balancer_type not in KINDS:
            return original(cp_mesh, inputs, attention_masks, load_balancer_type, input_seq_dim,
                            ptrr_mask_key=ptrr_mask_key)
        if positions is None:
            _no_positions(load_balancer_type)
        return shard(cp_mesh, inputs, attention_masks, load_balancer_type, input_seq_dim, positions)

    setattr(cp_shard, WRAPS, original)
    return cp_shard


def _trampoline(inputs: Any, labels: Any, extra_kwargs: dict[str, Any], cp_mesh: Any, device: Any,
                load_balancer_type: str | None = "headtail", ptrr_mask_key: str | None = None) -> Any:
    """The code torchtitan's ``prepare_context_parallel_input`` runs while a patch is in force (its
    ``__code__``, torchtitan 0.3.0's parameters and no closure, as ``_titan.api`` checks): it calls
    cpshard's replacement, which the patch binds in that function's own module (:data:`TRAMPOLINE`),
    so every reference to the function, whoever took it and however (by name, in a closure, pickled
    by value), reaches it."""
    return __cpshard_prepare__(inputs, labels, extra_kwargs, cp_mesh, device,  # noqa: F821  (the module's)
                               load_balancer_type, ptrr_mask_key)


def prepare_replacement(original: Callable[..., Any]) -> Callable[..., Any]:
    """torchtitan's ``prepare_context_parallel_input`` that, for cpshard's balancer types, shards the
    batch itself with its positions passed explicitly (``extra_kwargs["positions"]``: what torchtitan's
    passes third to ``cp_shard``), so no wrapper of ``cp_shard`` can hide them; torchtitan's own for its
    types. The same contract: ``(inputs, labels, extra_kwargs)``, ``extra_kwargs`` updated in place."""

    @functools.wraps(original)
    def prepare_context_parallel_input(inputs: Any, labels: Any, extra_kwargs: dict[str, Any], cp_mesh: Any,
                                       device: Any, load_balancer_type: str | None = "headtail",
                                       ptrr_mask_key: str | None = None) -> tuple[Any, Any, dict[str, Any]]:
        if load_balancer_type not in KINDS:
            return original(inputs, labels, extra_kwargs, cp_mesh, device, load_balancer_type, ptrr_mask_key)
        positions = extra_kwargs.get("positions")
        masks = extra_kwargs.get("attention_masks")
        (inputs, labels, positions), masks = shard(cp_mesh, (inputs, labels, positions), masks, load_balancer_type, 1,
                                                   positions, ("inputs", "labels", "extra_kwargs['positions']"))
        extra_kwargs["positions"] = positions
        if masks is not None:
            extra_kwargs["attention_masks"] = masks
        return inputs, labels, extra_kwargs

    setattr(prepare_context_parallel_input, WRAPS, original)
    return prepare_context_parallel_input


def patch() -> TitanPatch:
    """Make torchtitan's ``cp_shard`` (and so ``prepare_context_parallel_input``) accept
    ``load_balancer_type="cpshard"`` and ``"cpshard_zigzag"``, in this process; also a context manager
    that undoes itself. Checks torchtitan first (:func:`cpshard.compat.torchtitan._titan.api`:
    ``ImportError`` where it is missing, ``ValueError`` where its ``cp_shard`` differs from
    torchtitan 0.3.0's), then binds (module docstring) and logs one INFO line of what it bound.
    Where another patch holds the sites, returns an inactive patch that binds nothing.

    Example::

        from cpshard.compat import torchtitan as cptitan
        with cptitan.patch() as p:         # one process (a test); a job: import cpshard.compat.torchtitan.enable
            print(p.bound)
    """
    api = _titan.api()
    with LOCK:
        result = TitanPatch(_titan.torchtitan_version())
        if TitanPatch.in_force() is not None:
            return result
        prepare, cp_shard = vars(api)["prepare_context_parallel_input"], vars(api)["cp_shard"]
        if hasattr(cp_shard, WRAPS) or prepare.__code__ is _trampoline.__code__:  # another copy of cpshard's
            result.skipped[f"{_titan.API}.cp_shard"] = "cpshard's already (bound by another copy)"
            logger.warning("cpshard.compat.torchtitan: patch() bound nothing: torchtitan's cp_shard or "
                           "prepare_context_parallel_input is cpshard's already (another copy of cpshard, or a "
                           "wrapper left over an undone patch: cpshard.compat.torchtitan.active() says which)")
            return result
        own = types.FunctionType(prepare.__code__, prepare.__globals__, prepare.__name__, prepare.__defaults__,
                                 prepare.__closure__)  # torchtitan's function as it was: what cpshard's calls
        functools.update_wrapper(own, prepare, updated=())  # its name, qualname, module, doc, annotations
        own.__kwdefaults__ = prepare.__kwdefaults__
        result._pairs["prepare_context_parallel_input"] = (own, prepare_replacement(own))
        result._save(api, TRAMPOLINE, result._pairs["prepare_context_parallel_input"][1])  # what its code calls
        result._code = (prepare, prepare.__code__)
        prepare.__code__ = _trampoline.__code__  # every reference to the function, whoever took it
        result.bound.append(f"{_titan.API}.prepare_context_parallel_input")
        new = replacement(cp_shard)
        result._pairs["cp_shard"] = (cp_shard, new)
        result._bind(api, "cp_shard", new)
        for site in rebind("", {id(cp_shard): (cp_shard, new)}):  # every module that took it by name
            if site not in result.bound:
                module, name = site.rsplit(".", 1)
                result.bound.append(site)
                result._saved.append((sys.modules[module], name, cp_shard, new))
        if f"{_titan.PACKAGE}.cp_shard" not in result.bound:
            result.skipped[f"{_titan.PACKAGE}.cp_shard"] = "the package does not bind torchtitan's cp_shard here"
        result._hold()
        logger.info("cpshard.compat.torchtitan: torchtitan %s's prepare_context_parallel_input and cp_shard take "
                    "load_balancer_type %s at %d sites (pid %d): %s", result.torchtitan_version,
                    " / ".join(map(repr, KINDS)), len(result.bound), os.getpid(), ", ".join(result.bound))
        return result


def activate() -> TitanPatch:
    """Switch cpshard on in this process until ``undo()``: :func:`patch`, once. Idempotent: every call
    returns the same patch while it is active. A ``with patch():`` block in force is taken over: its
    patch is undone and the sites bound again by the process's own, so that leaving the block does not
    switch cpshard off (as verl's activation does). The ``cpshard.compat.torchtitan`` logger gets level
    INFO where it has none."""
    with LOCK:
        current = _PROCESS[0]
        if current is not None and current.active:
            return current
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
        held = TitanPatch.in_force()
        if held is not None:  # a with patch() block: its bindings become the process's
            logger.info("cpshard.compat.torchtitan: switched on for this process; the patch of a `with patch()` block "
                        "in force is undone and bound again for the process")
            held.undo()
        _PROCESS[0] = patch()
        return _PROCESS[0]


def process_patch() -> TitanPatch | None:
    """The patch :func:`activate` made, while it is in force."""
    current = _PROCESS[0]
    return current if current is not None and current.state == IN_FORCE else None


def last_process_patch() -> TitanPatch | None:
    """The patch :func:`activate` made last, in force or undone since (``enable.PATCH``)."""
    return _PROCESS[0]
