"""verl 0.9.1's FSDP engine on the CPU, on gloo: what a test needs to run verl's own ``FSDPEngineWithLMHead``.

verl builds this engine only on an accelerator. The smallest set of changes found that runs it unchanged
on the CPU (each one is a setting or a registration, nothing of verl's is replaced):

- a CPU platform (:class:`CpuPlatform`) registered with verl's ``PlatformRegistry`` and chosen by
  ``VERL_PLATFORM=cpu`` before the engine module is imported: the module reads the device name once,
  at import, for its device meshes and autocast;
- ``VERL_ENGINE_DEVICE=cuda``: the engine is registered for ``cuda`` and ``npu`` only, and
  ``EngineRegistry.get_engine_cls`` takes the device from this variable before the platform's;
- FSDP2 (``strategy="fsdp2"``): FSDP1 passes ``sync_module_states=True``, which torch refuses for
  modules on the CPU;
- the platform's current device is ``"cpu"``, not an index: verl moves modules and batches with
  ``.to(get_device_id())``, and torch reads an int as an accelerator's index;
- fp32 everywhere (``model_dtype="fp32"``, ``mixed_precision`` of fp32): verl's precision helper has
  no fp64, and fp32 skips autocast;
- ``use_torch_compile=False`` (the entropy), attention ``"sdpa"`` (no flash-attn here), no tokenizer
  (``load_tokenizer=False``), a tiny random Qwen2 saved with ``save_pretrained`` to a directory.

:func:`build` makes the engine as verl's ``TrainingWorker`` does (``EngineRegistry.new(...)``, then
``initialize()``); :func:`batch` is a micro-batch of packed documents in verl's no-padding format.
Used by tests/test_verl_fsdp_engine.py inside gloo ranks.

Sources read (not copied): verl 0.9.1's ``verl/plugin/platform/*.py``, ``verl/workers/engine/base.py``,
``verl/workers/engine/fsdp/transformer_impl.py``, ``verl/workers/engine_workers.py``,
``verl/workers/config/{engine,model,optimizer}.py``; verl main's (1dda039) ``tests/models/test_engine.py``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from typing import Any

import torch

VOCAB = 64
LENGTHS = [5, 11, 7]  # the packed documents of the engine tests


def skip_without_verl() -> None:
    """Skip the calling test module where verl or its FSDP engine's packages are missing."""
    import pytest

    try:
        import verl.utils.ulysses  # noqa: F401
    except ImportError as exc:  # scripts/setup.sh installs verl (constraints.txt, group verl); CI always runs these
        pytest.skip(f"verl cannot be imported ({exc}); run scripts/setup.sh", allow_module_level=True)
    missing = [m for m in ("transformers", "peft", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"verl's FSDP engine needs {', '.join(missing)}, not installed here: run scripts/setup.sh",
                    allow_module_level=True)


def weights() -> torch.Tensor:
    """One loss weight per token of :data:`LENGTHS`, the same in every configuration."""
    return torch.randn(sum(LENGTHS), generator=torch.Generator().manual_seed(3))


def gap(a: Any, b: Any) -> float:
    """The largest absolute difference, over tensors or dicts of them."""
    if isinstance(a, dict):
        return max(gap(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return (a - b).abs().max().item()
    return abs(a - b)


def skip_dataset_package_init() -> None:
    """``verl.utils.dataset`` as a bare package where Hugging Face ``datasets`` is not installed: its
    ``__init__`` imports the RL dataset (and ``datasets``, with pyarrow and pandas) while the engine
    needs only ``verl.utils.dataset.dataset_utils.DatasetPadMode``. The submodules import as they are."""
    name = "verl.utils.dataset"
    if name in sys.modules or importlib.util.find_spec("datasets") is not None:
        return
    spec = importlib.util.find_spec(name)
    package = types.ModuleType(name)
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    sys.modules[name] = package


def install_cpu_platform() -> None:
    """Register :class:`CpuPlatform` as verl's platform ``cpu`` and pick it (before verl reads it)."""
    skip_dataset_package_init()
    os.environ["VERL_PLATFORM"] = "cpu"
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    from verl.plugin.platform import PlatformBase, PlatformRegistry

    if PlatformRegistry.get("cpu") is not None:
        return

    @PlatformRegistry.register(platform="cpu")
    class CpuPlatform(PlatformBase):  # noqa: F841 - registered by the decorator
        """The CPU as verl's platform: gloo, no device memory, no profiler."""

        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: torch.cpu)

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:  # verl moves tensors and modules `.to(get_device_id())`: an
            return "cpu"                  # int would name an accelerator

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CPSHARD_NO_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None


def save_tiny_qwen2(path: str, *, seed: int = 0, heads: int = 4, kv_heads: int = 2, layers: int = 2) -> str:
    """A random Qwen2 (hidden 32, vocabulary :data:`VOCAB`) saved to ``path``; returns ``path``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def build(path: str, *, sp: int, clip_grad: float = 1e9, checkpointing: bool = True) -> Any:
    """verl's FSDP engine for the language model at ``path``, Ulysses degree ``sp``, as ``TrainingWorker``
    builds it: ``EngineRegistry.new(...)`` then ``initialize()``; ``checkpointing``: verl's
    ``enable_gradient_checkpointing`` (its default: the layers' forward recomputed in the backward). torch.distributed
    must be up."""
    install_cpu_platform()
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    model_config = HFModelConfig(path=path, load_tokenizer=False, use_remove_padding=True,
                                 override_config={"attn_implementation": "sdpa"},
                                 enable_gradient_checkpointing=checkpointing)
    model_config.model_type = "language_model"
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    engine_config = FSDPEngineConfig(strategy="fsdp2", ulysses_sequence_parallel_size=sp, use_torch_compile=False,
                                     model_dtype="fp32", mixed_precision=fp32, use_dynamic_bsz=False,
                                     micro_batch_size_per_gpu=64, infer_micro_batch_size_per_gpu=64,
                                     forward_only=False)
    engine_config.use_remove_padding = True
    optimizer_config = FSDPOptimizerConfig(lr=1e-3, clip_grad=clip_grad)
    engine = EngineRegistry.new(model_type="language_model", backend="fsdp2", model_config=model_config,
                                engine_config=engine_config, optimizer_config=optimizer_config,
                                checkpoint_config=None)
    engine.initialize()
    return engine


def batch(lengths: list[int], *, seed: int = 0, calculate_entropy: bool = True) -> Any:
    """Packed documents of ``lengths`` in verl's no-padding format (jagged ``input_ids``,
    ``position_ids`` from 0 in each document, ``loss_mask`` all ones), one micro-batch."""
    from verl.utils import tensordict_utils as tu

    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    jagged = lambda parts: torch.nested.as_nested_tensor(parts, layout=torch.jagged)  # noqa: E731
    data = tu.get_tensordict(
        tensor_dict={"input_ids": jagged(ids), "position_ids": jagged([torch.arange(n) for n in lengths]),
                     "loss_mask": jagged([torch.ones(n, dtype=torch.int64) for n in lengths])},
        non_tensor_dict={"temperature": 1.0, "use_remove_padding": True, "use_dynamic_bsz": False,
                         "micro_batch_size_per_gpu": len(lengths), "calculate_entropy": calculate_entropy,
                         "global_token_num": list(lengths)})
    return data


def hf_reference(path: str, lengths: list[int], weights: torch.Tensor, *, seed: int = 0) -> dict[str, Any]:
    """The same model in one process, each document alone: the log-probs and entropy of the packed row as
    verl defines them (every token's label is the next token of the packed row, rolled), and the
    gradients and their norm of :func:`weighted_loss`'s loss."""
    from transformers import AutoModelForCausalLM

    # no install_cpu_platform() here: this runs in the test process, which must keep verl's modules and
    # environment as they are for the modules after it (test_verl_ray's driver binds what its workers import)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    ids = batch(lengths, seed=seed)["input_ids"]
    logits = torch.cat([model(input_ids=d.unsqueeze(0)).logits[0] for d in ids.unbind()])
    logp = torch.log_softmax(logits, -1)
    log_probs = logp.gather(-1, torch.roll(ids.values(), -1)[:, None])[:, 0]
    (log_probs * weights).sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    return {"log_probs": log_probs.detach(), "entropy": -(logp.exp() * logp).sum(-1).detach(), "grads": grads,
            "grad_norm": float(norm)}


def weighted_loss(weights: torch.Tensor):
    """A loss for ``forward_backward_batch``: ``sum(w * log_probs)`` over the packed row (``weights``: one
    per token, the same for every configuration)."""

    def loss_function(model_output, data, dp_group=None):
        lp = model_output["log_probs"]
        lp = lp.values() if lp.is_nested else lp
        return (lp * weights.to(lp.dtype)).sum(), {}

    return loss_function


def step(engine: Any, lengths: list[int], weights: torch.Tensor, *, seed: int = 0) -> dict[str, Any]:
    """What verl's engine computes for the documents of ``lengths``: ``infer_batch``'s log-probs and
    entropy (in eval mode), then in train mode one ``forward_backward_batch`` of :func:`weighted_loss`:
    the whole gradients and ``optimizer_step``'s grad norm."""
    with engine.eval_mode():
        out = engine.infer_batch(batch(lengths, seed=seed))["model_output"]
    flat = {k: (v.values() if v.is_nested else v).detach().clone() for k, v in out.items() if k in ("log_probs",
                                                                                                     "entropy")}
    with engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward_batch(batch(lengths, seed=seed), weighted_loss(weights))
        flat["grads"] = full_grads(engine)
        flat["grad_norm"] = float(engine.optimizer_step())
    return flat


#: the modules of verl 0.9.1's FSDP path that bind verl's Ulysses helpers by name, and the names each binds
ULYSSES_BINDERS = {
    "verl.utils.ulysses": ("ulysses_pad", "ulysses_pad_and_slice_inputs", "slice_input_tensor",
                           "gather_outputs_and_unpad", "gather_seq_scatter_heads", "gather_heads_scatter_seq"),
    "verl.workers.engine.fsdp.transformer_impl": ("gather_outputs_and_unpad", "ulysses_pad",
                                                  "ulysses_pad_and_slice_inputs"),
}


@contextlib.contextmanager
def drop_ins_bound():
    """cpshard's Ulysses drop-ins bound by hand where the FSDP engine's path takes verl's, and nothing else
    (``cpshard.compat.verl.patch()`` binds them too, and makes the attention cpshard's), restored on exit."""
    from cpshard.compat import verl as cv

    saved = []
    try:
        for module_name, names in ULYSSES_BINDERS.items():
            module = importlib.import_module(module_name)
            for name in names:
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, cv.ULYSSES_DROP_INS[name])
        yield
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)


def full_grads(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (FSDP2 shards it: one all-gather each, on every rank)."""
    out = {}
    for name, p in engine.module.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out
