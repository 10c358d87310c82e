"""Shims that let megatron-core 0.16.1 run on a CPU-only torch build (gloo backend).

Megatron-Core assumes CUDA in a handful of places that are not about the maths: it asks
``torch.cuda.current_device()`` where to allocate buffers, keeps its RNG tracker in CUDA
generator states, calls ``torch.cuda.synchronize()`` while saving checkpoints, and
hard-codes ``device="cuda"`` in a few tensors (default causal mask, pipeline schedules,
tied-embedding sync). Each shim below replaces exactly one such call, and each one is
**inert when CUDA is available**: :func:`install` does nothing then, and every installed
replacement re-checks ``torch.cuda.is_available()`` on each call and forwards to the
original when it is true. Nothing here changes numerics.

Usage: call :func:`install` once, after ``import torch`` and before building a model
(``trainer.model.init_parallel`` does it). :func:`install` is idempotent;
:func:`uninstall` restores every original (tests use it).

Shims (name -> what it replaces, and why):

- ``current_device``: ``torch.cuda.current_device`` returns ``torch.device("cpu")``.
  Megatron passes its result as ``device=`` for rotary-embedding frequencies, the global
  memory buffer, tensor-parallel gather buffers, DDP grad buffers and checkpoint
  bookkeeping tensors; on a CPU build the original raises "Torch not compiled with CUDA".
- ``synchronize``: ``torch.cuda.synchronize`` becomes a no-op. ``dist_checkpointing``
  calls it while saving; with no device there is nothing to wait for.
- ``rng_tracker``: ``megatron.core.tensor_parallel.random.CudaRNGStatesTracker`` is
  replaced by :class:`CpuRNGStatesTracker`, which keeps and swaps CPU generator states.
  Attention (and GPU-style weight init) always enters ``get_cuda_rng_tracker().fork()``,
  whose original reads/writes CUDA generator states. ``model_parallel_cuda_manual_seed``
  then works unchanged (its ``torch.cuda.manual_seed`` is a lazy no-op on CPU builds).
- ``causal_mask``: ``megatron.core.transformer.utils.get_default_causal_mask`` (and the
  name imported into ``fusions.fused_softmax``) builds the mask on CPU. Only used when a
  caller passes ``attention_mask=None``; ``trainer.model.forward_logprobs`` always passes
  an explicit mask, so this is a safety net.
- ``schedules``: ``megatron.core.pipeline_parallel.schedules`` allocates its token counter
  with ``device="cuda"``; its module-level ``torch`` is replaced by a proxy whose
  ``zeros/ones/empty/full/tensor`` map a CUDA device to CPU (everything else is torch).
- ``tied_embeddings``: ``LanguageModule.setup_embeddings_and_output_layer`` calls
  ``weight.data.cuda()`` when embeddings are tied across pipeline stages (PP > 1); the
  wrapper makes ``Tensor.cuda`` return the tensor unchanged for the duration of that call.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")

# name -> (owner object, attribute, original value); filled by install(), emptied by uninstall().
_ORIGINALS: dict[str, tuple[Any, str, Any]] = {}


def shims_needed() -> bool:
    """The decision every shim hangs on: shims apply only when CUDA is not available."""
    return not torch.cuda.is_available()


def installed() -> list[str]:
    """Names of the shims currently installed (empty on CUDA machines)."""
    return sorted(_ORIGINALS)


# --------------------------------------------------------------------------- torch.cuda


def _current_device_shim(original: Callable[[], Any]) -> Callable[[], Any]:
    @functools.wraps(original)
    def current_device():
        if not shims_needed():
            return original()
        return _CPU

    current_device._rtrl_shim = True  # type: ignore[attr-defined]
    return current_device


def _synchronize_shim(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def synchronize(device=None):
        if not shims_needed():
            return original(device)
        return None

    synchronize._rtrl_shim = True  # type: ignore[attr-defined]
    return synchronize


# --------------------------------------------------------------------------- RNG tracker


_CPU_TRACKER_CLS = None


def _cpu_tracker_class():
    """Build :class:`CpuRNGStatesTracker` once, as a subclass of megatron's original tracker."""
    global _CPU_TRACKER_CLS
    if _CPU_TRACKER_CLS is not None:
        return _CPU_TRACKER_CLS
    from megatron.core.tensor_parallel import random as mrandom

    base = mrandom.CudaRNGStatesTracker
    assert not getattr(base, "_rtrl_shim", False), "the original tracker class must be the base"

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """Megatron's RNG tracker with CPU generator states instead of CUDA ones.

        Same contract as ``CudaRNGStatesTracker``: ``add(name, seed)`` registers a named
        state, ``fork(name)`` swaps it into the (CPU) default generator for the block and
        stores the advanced state on exit. On a CUDA machine every method defers to the
        original class.
        """

        def add(self, name, seed):
            if not shims_needed():
                return super().add(name, seed)
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if not shims_needed():
                with super().fork(name):
                    yield
                return
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            # The CPU default generator is process-wide: a fork in one thread (say a policy server
            # sampling) must not interleave with one in another (the trainer). One at a time.
            with _FORK_LOCK:
                with self._fork_locked(name):
                    yield

        @contextlib.contextmanager
        def _fork_locked(self, name):
            orig_state = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                if self._current_state_name != name:
                    raise Exception(f"current state name {self._current_state_name} is not the desired {name}")
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    _FORK_LOCK = threading.RLock()
    CpuRNGStatesTracker._rtrl_shim = True  # type: ignore[attr-defined]
    _CPU_TRACKER_CLS = CpuRNGStatesTracker
    return CpuRNGStatesTracker


def _swap_existing_tracker(tracker_cls) -> None:
    """If megatron already built a CUDA-state tracker, rebuild it with ``tracker_cls``.

    On a CPU build such a tracker can hold no states (adding one fails), so nothing is lost.
    """
    from megatron.core.tensor_parallel import random as mrandom

    old = mrandom._CUDA_RNG_STATE_TRACKER
    if old is None or getattr(type(old), "_rtrl_shim", False):
        return
    new = tracker_cls(
        use_cudagraphable_rng=getattr(old, "use_cudagraphable_rng", False),
        is_inference_rng_tracker=getattr(old, "is_inference_rng_tracker", False),
    )
    mrandom._CUDA_RNG_STATE_TRACKER = new


# --------------------------------------------------------------------------- CUDA-device literals


def _cpu_causal_mask(original):
    @functools.wraps(original)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        if not shims_needed():
            return original(sq)
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    get_default_causal_mask._rtrl_shim = True  # type: ignore[attr-defined]
    return get_default_causal_mask


def _is_cuda_device(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, int):
        return True  # an int device index means a CUDA ordinal
    return str(device).startswith("cuda")


class _CpuTorchProxy:
    """Stands in for the ``torch`` module inside one megatron module: tensor factories that
    ask for a CUDA device get CPU while CUDA is unavailable; every other attribute is torch's."""

    _rtrl_shim = True
    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange")

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        value = getattr(self._real, name)
        if name in self._FACTORIES:

            @functools.wraps(value)
            def factory(*args, **kwargs):
                if shims_needed() and _is_cuda_device(kwargs.get("device")):
                    kwargs["device"] = _CPU
                return value(*args, **kwargs)

            return factory
        return value


def _tied_embeddings_shim(original):
    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self, *args, **kwargs):
        if not shims_needed():
            return original(self, *args, **kwargs)
        real_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t  # type: ignore[method-assign]
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = real_cuda  # type: ignore[method-assign]

    setup_embeddings_and_output_layer._rtrl_shim = True  # type: ignore[attr-defined]
    return setup_embeddings_and_output_layer


# --------------------------------------------------------------------------- install / uninstall


def _patch(name: str, owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
    original = getattr(owner, attr)
    if getattr(original, "_rtrl_shim", False):  # already patched (e.g. module reloaded)
        return
    _ORIGINALS[name] = (owner, attr, original)
    setattr(owner, attr, make(original))


def install() -> list[str]:
    """Install every shim if CUDA is unavailable; returns the names installed (``[]`` on CUDA).

    Idempotent: a second call changes nothing and returns the same names.
    """
    if not shims_needed():
        return []
    if _ORIGINALS:
        return installed()

    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.language_module import language_module
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils as tutils

    _patch("current_device", torch.cuda, "current_device", _current_device_shim)
    _patch("synchronize", torch.cuda, "synchronize", _synchronize_shim)

    cpu_tracker = _cpu_tracker_class()
    _patch("rng_tracker", mrandom, "CudaRNGStatesTracker", lambda original: cpu_tracker)
    _swap_existing_tracker(cpu_tracker)

    _patch("causal_mask", tutils, "get_default_causal_mask", _cpu_causal_mask)
    _patch("causal_mask_fused_softmax", fused_softmax, "get_default_causal_mask", _cpu_causal_mask)
    _patch("schedules", schedules, "torch", lambda real: _CpuTorchProxy(real))
    _patch(
        "tied_embeddings",
        language_module.LanguageModule,
        "setup_embeddings_and_output_layer",
        _tied_embeddings_shim,
    )
    log.debug("cpu_compat: installed %s", installed())
    return installed()


def uninstall() -> None:
    """Restore every original replaced by :func:`install` (for tests).

    A tracker *instance* megatron already created from :class:`CpuRNGStatesTracker` stays in
    place with its seeded states (a new one could not be seeded on CPU); it defers to the
    original behaviour whenever CUDA is available.
    """
    for name, (owner, attr, original) in list(_ORIGINALS.items()):
        setattr(owner, attr, original)
        del _ORIGINALS[name]
