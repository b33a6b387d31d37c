"""What `ddiloco export --hf-dir` writes beside the model, and `--push-to-hub`.

* the byte-level tokenizer of the built-in hf task (token id = UTF-8 byte, 256 ids,
  no special tokens) as a ``PreTrainedTokenizerFast``, so that
  ``AutoTokenizer.from_pretrained(DIR)`` works next to ``AutoModelForCausalLM``;
* a model card (README.md): the run's settings, the fragment versions exported and
  the newest validation loss of the global model the syncer measured;
* ``push_to_hub``: the directory uploaded to a Hugging Face Hub model repository
  through ``huggingface_hub``. With ``DDILOCO_HUB_DIR`` set, the repository is a
  local directory ``$DDILOCO_HUB_DIR/OWNER/NAME`` instead (no hub is reachable in
  tests or on an air-gapped cluster; a mirror can be synced from there).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from ddiloco_cli.errors import UsageError

HUB_DIR_ENV = "DDILOCO_HUB_DIR"
BYTE_VOCAB = 256  # the hf task's tokenizer (ddiloco_cli.tasks.hf)
# the run settings the card lists first; the rest follow in a table
_CARD_KEYS = ("task", "num_fragments", "sync_every", "overlap_steps", "inner_lr", "outer_lr", "outer_momentum",
              "batch_size", "codec", "merge", "total_steps")


def save_byte_tokenizer(out_dir: str) -> None:
    """A fast tokenizer mapping each UTF-8 byte to its value (ids 0..255) and back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False).save_pretrained(out_dir)


def model_card(run: dict[str, Any], versions: dict[int, int], *, num_params: int,
               val: dict[str, Any] | None) -> str:
    """README.md for the exported directory (YAML front matter, then the run)."""
    loss = f"{val['val_loss']:.4f} (syncer evaluation at merge {val['step']})" if val else "not measured"
    lines = ["---", "library_name: transformers", "tags: [ddiloco, diloco]", "---", "",
             f"# ddiloco run {run['run_id']}", "",
             f"Trained with Decoupled DiLoCo (`ddiloco`): {num_params:,} parameters, assembled from "
             f"{len(versions)} fragments at versions {min(versions.values(), default=0)}.."
             f"{max(versions.values(), default=0)}.", "",
             f"Final validation loss of the global model: {loss}.", "",
             "The tokenizer is byte-level: token id = UTF-8 byte (vocabulary 256).", "",
             "## Run settings", "", "| setting | value |", "|---|---|"]
    for key in (*[k for k in _CARD_KEYS if k in run], *sorted(k for k in run if k not in _CARD_KEYS)):
        if key in ("admin_key", "features"):
            continue
        value = json.dumps(run[key]) if isinstance(run[key], (dict, list)) else run[key]
        lines.append(f"| {key} | `{value}` |")
    return "\n".join(lines) + "\n"


def push_to_hub(out_dir: str, repo: str) -> str:
    """Upload ``out_dir`` to the model repository ``repo`` (OWNER/NAME); returns where it went."""
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise UsageError(f"--push-to-hub {repo!r}: give the repository as OWNER/NAME")
    local = os.environ.get(HUB_DIR_ENV)
    if local:
        dest = os.path.join(local, repo)
        shutil.copytree(out_dir, dest, dirs_exist_ok=True)
        return dest
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise UsageError("--push-to-hub needs huggingface_hub: pip install 'ddiloco[hf]'") from None
    api = HfApi()
    api.create_repo(repo, repo_type="model", exist_ok=True)
    api.upload_folder(folder_path=out_dir, repo_id=repo, repo_type="model",
                      commit_message="ddiloco export")
    return f"https://huggingface.co/{repo}"
