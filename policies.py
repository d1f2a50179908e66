"""Policies: the base model, hand-written LoRA adapters, and which role trains which weights.

    model, tok = load("toy" | "0.6b" | "1.7b" | "4b" | "smollm2-135m" | "/path/to/hf/folder")
    policy = Policy(model, tok, roles=("generator", "aggregator"), sharing="isolated")
    with policy.using(policy.adapter("aggregator")) as m:   # m is the module to call
        logits = m(input_ids, attention_mask=..., position_ids=...).logits

Choices, each a flag of train.py:
- LoRA (`--lora-rank 64 --lora-alpha 32`, the paper's values) on every nn.Linear of the frozen
  base except the output head; y = W x + (alpha / r) * B A x with A ~ kaiming-uniform and B = 0,
  so a fresh adapter leaves the base unchanged. The adapters live here, not inside the model:
  one forward hook per linear layer adds the delta of the *active* adapter, so the model object
  stays a plain Hugging Face model (save_pretrained, generate and KL-to-base keep working).
  The delta is computed in the base's dtype, x A^T then one in-place addmm_ (B^T, scale, add); the
  adapters' parameters stay fp32. A bf16 base (the default on CUDA) adds the small delta in
  bf16. On CUDA, fp32 matmuls may use TF32 and cuDNN's attention is off (`cuda_settings`, from
  `load`).
- `--sharing shared`: one adapter "shared" for every role. `--sharing isolated`: one adapter per
  role type (the 3 voters share "generator", all workers share "worker").
- `--isolation full`: instead of adapters, a full trainable copy of the model per adapter name
  (small models only); the loaded model stays frozen as the base.
- `--grad-checkpointing`: `checkpoint_layers` recomputes each decoder layer in the backward;
  `auto` (the default) turns it on only where a micro-batch's activations would not fit
  (`checkpointing_plan`, said in the memory plan's line), since the recompute is a third more
  FLOPs (bench/memory.py counts the memory with and without, docs/REAL_MODELS.md).
- The active adapter is one name for the whole batch, or `None` for the base.
- Adapters are saved in PEFT's file layout (adapter_config.json + adapter_model.safetensors with
  keys `base_model.model.<module>.lora_A.weight`), so peft and vLLM's multi-LoRA serving load a
  trained role as it is; `export_merged` writes W + (alpha/r) B A as an ordinary model folder.
"""
import contextlib
import copy
import json
import math
import os

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import gguf_models

HUB_IDS = {"0.6b": "Qwen/Qwen3-0.6B", "1.7b": "Qwen/Qwen3-1.7B", "4b": "Qwen/Qwen3-4B"}


# ----------------------------------------------------------------------------- loading

def check_scale(scale: str) -> None:
    """ValueError unless `scale` is toy, a hub scale name, an offline model whose packages are
    installed (gguf_models.MODELS), or a folder holding a config.json."""
    if scale == "toy" or scale in HUB_IDS:
        return
    if scale in gguf_models.MODELS:
        gguf_models.check(scale)
        return
    if not os.path.isdir(scale):
        raise ValueError(f"--scale {scale!r}: no such folder (expected toy, {', '.join(HUB_IDS)}, "
                         f"{', '.join(gguf_models.MODELS)}, or a local model folder)")
    if not os.path.isfile(os.path.join(scale, "config.json")):
        raise ValueError(f"--scale {scale}: folder has no config.json, so it is not a model folder")


def load(scale: str, device: str = "cpu", dtype: torch.dtype | None = None, toy_task: str = "math",
         quiet: bool = False, toy_check: int = 0, toy_seed: int = 0):
    """(model, tokenizer) for a scale name (a hub id, or an offline model converted once into the
    cache: gguf_models.py), `toy` (the warm-started toy model of `toy_task`, with supervisors'
    checks of `toy_check` tokens, from warm-start seed `toy_seed`: the shipped one, else built on
    first use), or a local Hugging Face model folder; `quiet`: no progress bars.

    The base model is frozen (requires_grad False) and in eval mode (no dropout)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if quiet:   # transformers' own bars: loading weights, writing shards
        hf_logging.disable_progress_bar()

    if dtype is None:  # bf16 on GPU as in the paper; fp32 on CPU where bf16 matmuls are slow
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if str(device).startswith("cuda"):
        cuda_settings(device)
    check_scale(scale)
    reading = contextlib.nullcontext()
    if scale == "toy":
        import toy
        path = toy.model_folder(toy_task, toy.settings(toy_check, toy_seed), quiet=quiet)
        reading = toy.reading(path)   # a rebuild cannot replace a cached model while it loads
    elif scale in gguf_models.MODELS:
        import toy
        path = gguf_models.folder(scale, quiet=quiet)
        reading = toy.reading(path)
    else:
        path = HUB_IDS.get(scale, scale)
    try:
        with reading:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as e:  # offline, unknown repo, missing files
        raise RuntimeError(f"could not load {path!r} ({str(e).splitlines()[0][:160]}); "
                           f"download it once with `hf download {path} --local-dir FOLDER` (huggingface_hub) on a "
                           f"machine with network and pass that local folder as --scale") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device).eval().requires_grad_(False)
    return model, tokenizer


def cuda_settings(device) -> None:
    """What a run on a CUDA device sets for the whole process (train.py and eval.py, through
    `load`):
    - `cuda:N` becomes the current device: streams, events and CUDA graphs made without naming a
      device go to the current one (cuda:0 unless set), not to where the model is. A plain `cuda`
      is the current device already (and torch.cuda.set_device refuses it);
    - fp32 matmuls (the adapters' update, an fp32 base) run in TF32;
    - cuDNN's SDPA kernel is off, so attention runs the memory-efficient kernel wherever a mask
      is passed (decode, a padded training batch) and flash where none is (prefill, a batch
      without padding): PyTorch 2.9 and later try cuDNN's first on H100/H200, and it builds a
      plan for every new shape, while this project's shapes change at every call and
      micro-batch (bench/sdpa.py times each kernel on new shapes). A global switch, not a
      context, so a checkpointed layer's recompute in the backward picks what its forward
      picked. engine.generate also pins the kernels for its own calls (attention_kernels), for
      callers that never loaded through here (the bench scripts)."""
    device = torch.device(device)
    if device.index is not None:
        torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.enable_cudnn_sdp(False)


def attention_kernels(device):
    """A context pinning the SDPA kernels of a CUDA device as `cuda_settings` does for the whole
    process: flash, memory-efficient or math, never cuDNN's; nothing elsewhere (CPU results stay
    as they are)."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def stop_ids(model, tokenizer) -> list:
    """Every id that ends a completion: all generation-config eos ids (Qwen has two) + the
    tokenizer's eos."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids = eos if isinstance(eos, (list, tuple)) else [eos]
    ids = [i for i in ids if i is not None] + [tokenizer.eos_token_id]
    return sorted({int(i) for i in ids if i is not None})


def checkpoint_layers(model) -> None:
    """Activation checkpointing: each decoder layer keeps only its input for the backward and
    is recomputed there (torch.utils.checkpoint, non-reentrant), so a training micro-batch
    holds one layer's activations instead of all of them. Wraps `model.model.layers[i].forward`
    on the instance, so it works whatever the transformers version's own switch is called; it
    is a no-op without grad (sampling, old logprobs). The LoRA hooks run again in the
    recompute, so the backward must run while the same adapter is active (grpo.py does)."""
    from torch.utils.checkpoint import checkpoint
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no model.layers to checkpoint")
    for layer in layers:
        if getattr(layer, "_checkpointed", False):
            continue
        def forward(*args, _f=layer.forward, **kwargs):
            if torch.is_grad_enabled():
                return checkpoint(_f, *args, use_reentrant=False, **kwargs)
            return _f(*args, **kwargs)
        layer.forward, layer._checkpointed = forward, True


ACTIVATION_SHARE = 0.5   # share of the free memory a micro-batch's activations may take unchecked


def activation_bytes(config, tokens: int, itemsize: int, repeated_kv: bool = False) -> int:
    """Bytes a training micro-batch of `tokens` keeps for its backward without checkpointing, by
    count: per layer and token the tensors its ops save, about 6 h + 4 Hq D + 4 Hkv D + 4 I
    elements (the norms' and projections' inputs, q/k/v after norm and RoPE, the attention's
    output and log-sum-exp, the MLP's gate, up, activation and product), with no attention
    square (the packed forward's kernels keep none); in half precision also the fp32 inputs the
    RMSNorms keep (they compute in fp32): 2 h + Hq D + Hkv D more elements of 4 bytes.
    `repeated_kv` (where `not packed.gqa_kernel`: fp32 on CUDA): the attention keeps K and V with
    their heads repeated, 2 (Hq - Hkv) D more elements."""
    c = config
    h, I = c.hidden_size, c.intermediate_size
    hd = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    per = (6 * h + 4 * q + 4 * kv + 4 * I + (2 * (q - kv) if repeated_kv else 0)) * itemsize \
        + (4 * (2 * h + q + kv) if itemsize < 4 else 0)
    return tokens * c.num_hidden_layers * per


def checkpointing_plan(model, token_budget: int):
    """(checkpoint or not, one line why) for `--grad-checkpointing auto`: off where a full
    micro-batch's activations (`activation_bytes`) fit in ACTIVATION_SHARE of the memory free
    after loading (the device's, or the host's on a CPU), on otherwise."""
    import packed   # here, not at the top: flags.check_args (sweep.py's too) imports this module, not transformers
    p = next(model.parameters())
    need = activation_bytes(model.config, token_budget, p.element_size(),
                            repeated_kv=not packed.gqa_kernel(p.device, p.dtype))
    if p.device.type == "cuda":
        free = torch.cuda.mem_get_info(p.device)[0]
    else:
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    on = need > ACTIVATION_SHARE * free
    return on, (f"gradient checkpointing {'on' if on else 'off'} (auto): a {token_budget}-token micro-batch keeps "
                f"{need / 2**30:.2f} GiB of activations, {'more' if on else 'less'} than {ACTIVATION_SHARE:g} of the "
                f"{free / 2**30:.1f} GiB free")


# ----------------------------------------------------------------------------- LoRA

# Optimizer steps taken in this process, by any optimizer: the bf16 copies of the adapters
# (LoRA.weights) are refreshed when it moves, since a fused AdamW writes the parameters
# without moving their version counters.
STEPS = [0]
register_optimizer_step_post_hook(lambda *_: STEPS.__setitem__(0, STEPS[0] + 1))


def lora_targets(model) -> dict:
    """name -> nn.Linear for every linear layer LoRA adapts (all but the output head)."""
    head = model.get_output_embeddings()
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}


class LoRA(nn.Module):
    """Named low-rank adapters over the linear layers of a frozen model, applied by hooks."""

    def __init__(self, model, names, rank: int = 64, alpha: float = 32.0):
        super().__init__()
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.targets = lora_targets(model)
        self.active = None  # None (base) or an adapter name
        self._cast = {}     # (name, layer, dtype) -> [(steps, versions), A, B]: see weights
        # per adapter name, one parameter list aligned with `targets` (module names contain
        # dots, which parameter-dict keys may not)
        self.A = nn.ModuleDict()
        self.B = nn.ModuleDict()
        for name in names:
            self.add(name)
        self._hooks = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.targets.values())]

    def add(self, name: str):
        mods = list(self.targets.values())
        p = next(mods[0].parameters())
        A = nn.ParameterList()
        B = nn.ParameterList()
        for m in mods:
            a = torch.empty(self.rank, m.in_features, device=p.device, dtype=torch.float32)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # as nn.Linear initialises its weight
            A.append(nn.Parameter(a))
            B.append(nn.Parameter(torch.zeros(m.out_features, self.rank, device=p.device)))
        self.A[name], self.B[name] = A, B

    def weights(self, name: str, i: int, dtype):
        """(A, B) of adapter `name` at layer i in `dtype` (the base's). On an fp32 base (the toy,
        every CPU run) they are the parameters themselves. Otherwise casts: ones that carry the
        gradient back when grad is on, else copies kept until an optimizer step (STEPS) or an
        in-place edit (the versions) changes them, refreshed in place (a CUDA graph reads them)."""
        A, B = self.A[name][i], self.B[name][i]
        if dtype == A.dtype or torch.is_grad_enabled():
            return A.to(dtype), B.to(dtype)
        held = self._cast.get((name, i, dtype))
        if held is None:
            held = self._cast[name, i, dtype] = [None, A.detach().to(dtype), B.detach().to(dtype)]
        if held[0] != (STEPS[0], A._version, B._version):    # in place: a CUDA graph reads them
            held[0] = (STEPS[0], A._version, B._version)
            held[1].copy_(A)
            held[2].copy_(B)
        return held[1], held[2]

    def add_delta(self, name: str, i: int, x, out):
        """out + scale x A^T B^T in the base's dtype: x A^T (N, r), then one addmm that multiplies
        by B^T, scales and adds into the base's output in place (no second (N, out) tensor: the
        linear's backward needs its input, not its output, so autograd allows it). On a bf16 base
        the small delta is added in bf16, so a delta far below the output's bf16 resolution is
        lost (as in every bf16 LoRA)."""
        A, B = self.weights(name, i, out.dtype)
        u = x.reshape(-1, x.shape[-1]) @ A.t()                                  # (N, r)
        return out.view(-1, out.shape[-1]).addmm_(u, B.t(), alpha=self.scale).view(out.shape)   # (N, out)

    def _hook(self, i: int):
        def hook(module, inputs, out):
            if self.active is None:
                return out
            return self.add_delta(self.active, i, inputs[0], out)
        return hook

    def merged_weight(self, name: str, i: int, weight):
        """W + scale * B A, in W's dtype."""
        return (weight.float() + self.scale * self.B[name][i] @ self.A[name][i]).to(weight.dtype)

    def remove(self):
        for h in self._hooks:
            h.remove()


# ----------------------------------------------------------------------------- Policy

class Policy(nn.Module):
    """Role -> trainable weights. `shared`: one adapter; `isolated`: one per role type."""

    def __init__(self, model, tokenizer, roles, sharing: str = "shared", isolation: str = "lora",
                 rank: int = 64, alpha: float = 32.0, checkpointing: bool = False):
        super().__init__()
        if sharing not in ("shared", "isolated"):
            raise ValueError(f"sharing must be shared or isolated, got {sharing!r}")
        if isolation not in ("lora", "full"):
            raise ValueError(f"isolation must be lora or full, got {isolation!r}")
        self.model, self.tokenizer = model, tokenizer
        self.roles, self.sharing, self.isolation = tuple(roles), sharing, isolation
        self.names = ["shared"] if sharing == "shared" else list(dict.fromkeys(self.roles))
        model.requires_grad_(False)
        if isolation == "lora":
            self.lora = LoRA(model, self.names, rank, alpha)
        else:  # a full trainable copy per adapter name; the loaded model stays the frozen base
            layers = getattr(getattr(model, "model", None), "layers", [])
            if any(getattr(layer, "_checkpointed", False) for layer in layers):
                raise ValueError("full copies need a model that is not checkpointed yet (copies would share its layers)")
            self.copies = nn.ModuleDict({n: copy.deepcopy(model).requires_grad_(True) for n in self.names})
        self.checkpointing = checkpointing
        if checkpointing:  # after the copies: a deep copy would keep calling the original's layers
            for m in [model, *(self.copies.values() if isolation == "full" else [])]:
                checkpoint_layers(m)

    def adapter(self, role: str) -> str:
        """Name of the weights a role uses and updates."""
        if role not in self.roles:
            raise KeyError(f"unknown role {role!r}; this workflow has {self.roles}")
        return "shared" if self.sharing == "shared" else role

    def parameters_of(self, name: str) -> list:
        if self.isolation == "full":
            return list(self.copies[name].parameters())
        return list(self.lora.A[name].parameters()) + list(self.lora.B[name].parameters())

    @contextlib.contextmanager
    def using(self, name):
        """Yield the module to call with adapter `name` active (None: the frozen base)."""
        if self.isolation == "full":
            yield self.model if name is None else self.copies[name]
            return
        prev, self.lora.active = self.lora.active, name
        try:
            yield self.model
        finally:
            self.lora.active = prev

    @contextlib.contextmanager
    def inference(self, name):
        """Like `using`, for forwards without grad: on an fp32 base the adapter is folded into the
        base weights (W + scale B A) for the duration, one matmul a layer instead of the hook's
        three, and the base's own weights are put back exactly after. On a bf16 base the hooks
        run, since folding would round the adapter's small update into the base's precision."""
        if self.isolation == "full" or name is None or torch.is_grad_enabled() \
                or next(self.model.parameters()).dtype != torch.float32:
            with self.using(name) as model:
                yield model
            return
        mods = list(self.lora.targets.values())
        base = [m.weight.data for m in mods]
        prev, self.lora.active = self.lora.active, None
        try:
            for i, m in enumerate(mods):
                m.weight.data = self.lora.merged_weight(name, i, base[i])
            yield self.model
        finally:
            for m, w in zip(mods, base):
                m.weight.data = w
            self.lora.active = prev

    # ------------------------------------------------------------------------- files

    def save(self, folder: str):
        """One sub-folder per adapter name, in PEFT's layout (LoRA) or as a model folder (full)."""
        for name in self.names:
            d = os.path.join(folder, name)
            os.makedirs(d, exist_ok=True)
            if self.isolation == "full":
                self.copies[name].save_pretrained(d)
                continue
            from safetensors.torch import save_file
            tensors = {}
            for i, mod_name in enumerate(self.lora.targets):
                key = f"base_model.model.{mod_name}"
                tensors[f"{key}.lora_A.weight"] = self.lora.A[name][i].detach().contiguous().cpu()
                tensors[f"{key}.lora_B.weight"] = self.lora.B[name][i].detach().contiguous().cpu()
            save_file(tensors, os.path.join(d, "adapter_model.safetensors"), metadata={"format": "pt"})
            short = sorted({n.rsplit(".", 1)[-1] for n in self.lora.targets})
            cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.lora.rank,
                   "lora_alpha": self.lora.alpha, "lora_dropout": 0.0, "bias": "none",
                   "target_modules": short, "fan_in_fan_out": False, "inference_mode": True,
                   "use_rslora": False, "modules_to_save": None,
                   "base_model_name_or_path": getattr(self.model.config, "_name_or_path", "")}
            with open(os.path.join(d, "adapter_config.json"), "w") as f:
                json.dump(cfg, f, indent=2)

    def load_adapters(self, folder: str):
        """Load what `save` wrote (names missing from the folder raise)."""
        for name in self.names:
            d = os.path.join(folder, name)
            if self.isolation == "full":
                from transformers import AutoModelForCausalLM
                src = AutoModelForCausalLM.from_pretrained(d, dtype=next(self.model.parameters()).dtype)
                self.copies[name].load_state_dict(src.state_dict())
                continue
            from safetensors.torch import load_file
            path = os.path.join(d, "adapter_model.safetensors")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no adapter {name!r} in {folder} (expected {path})")
            t = load_file(path)
            with torch.no_grad():
                for i, mod_name in enumerate(self.lora.targets):
                    key = f"base_model.model.{mod_name}"
                    self.lora.A[name][i].copy_(t[f"{key}.lora_A.weight"])
                    self.lora.B[name][i].copy_(t[f"{key}.lora_B.weight"])

    def export_merged(self, name: str, folder: str):
        """Write base + adapter `name` as an ordinary Hugging Face model folder."""
        if self.isolation == "full":
            self.copies[name].save_pretrained(folder)
        else:
            sd = self.model.state_dict()
            with torch.no_grad():
                for i, mod_name in enumerate(self.lora.targets):
                    k = f"{mod_name}.weight"
                    sd[k] = self.lora.merged_weight(name, i, sd[k])
            self.model.save_pretrained(folder, state_dict=sd)
        self.tokenizer.save_pretrained(folder)

