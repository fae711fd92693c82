"""Check Megatron-Bridge overrides with Megatron-Bridge's own config loader (opt-in test).

Usage:
    python3.12 mb_config_check.py RECIPE MODE OVERRIDES_FILE
    python3.12 mb_config_check.py --dump-keys

RECIPE is a `--recipe` name of run_recipe.py (a function exported by megatron.bridge.recipes,
e.g. nemotron_3_nano_pretrain_config), MODE is `pretrain` or `sft`, and OVERRIDES_FILE holds one
override word per line, exactly as the op passes it to run_recipe.py (no shell quoting:
`checkpoint.save='/abs/out/checkpoint'`).

It needs a Python 3.12 with megatron-bridge 0.6.x installed (the tests find it through
NEMO_DAG_MB_PYTHON; docs/scale.md says how to build one). It does what
https://github.com/NVIDIA-NeMo/Megatron-Bridge scripts/training/run_recipe.py (v0.6.0) does up to
the start of training:

1. build the recipe's ConfigContainer. The SFT recipes (and super3 pretrain) call
   AutoBridge.from_hf_pretrained while the config is built; with HF_HUB_OFFLINE=1 and no Hub
   cache that fails, and the check then uses `_sft_common()` (sft) or the nano3 pretrain recipe
   (pretrain) with the nano3 pretrain model, and says so on stderr. Any other failure to build
   the recipe is an error;
2. apply the overrides with MB's `process_config_with_overrides` (struct-mode Hydra: an unknown
   key is an error). Words starting with `+` or `~` are refused here: MB accepts `+unknown=1`
   and silently skips it, and the op never renders them;
3. run the semantic check of the dataset config: `cfg.dataset.finalize()` (pretrain,
   GPTDatasetConfig) or `cfg.dataset.validate()` (sft, GPTSFTDatasetConfig). Neither opens the
   files the paths name, so the paths need not exist.

Prints `ok` and exits 0, or prints `error: ...` and exits 1. Exit 2: bad usage; exit 3:
megatron-bridge cannot be imported (the caller should skip, not fail).

`--dump-keys` prints tests/fixtures/megatron-bridge-0.6-keys.txt: the dotted key tree (leaves
and intermediate keys) of the nano3 pretrain ConfigContainer, as
`OmegaConf.to_container(create_omegaconf_dict_config(cfg)[0])`, plus the `dataset.*` keys of
`_sft_common()`.

The CUDA-only modules that MB imports at module level (transformer_engine, mamba_ssm, ...) are
replaced by MagicMock modules; building a config never calls them.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import logging
import os
import sys
import warnings
from unittest.mock import MagicMock

STUBBED = (
    "transformer_engine",
    "transformer_engine_torch",
    "flashinfer",
    "fast_hadamard_transform",
    "mamba_ssm",
    "causal_conv1d",
    "nvidia_resiliency_ext",
    "fla",
)

NANO_PRETRAIN = "nemotron_3_nano_pretrain_config"


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import any module under STUBBED as a MagicMock package."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = MagicMock(name=spec.name)
        module.__path__ = []
        module.__spec__ = spec
        module.__version__ = "2.20.2"  # some callers compare TE's version
        return module

    def exec_module(self, module):
        pass


def quiet():
    """Silence MB's import-time warnings and INFO logs: stdout carries the verdict only."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def import_mb():
    """Import what the check needs, or exit 3 with the reason."""
    sys.meta_path.insert(0, _StubFinder())
    try:
        recipes = importlib.import_module("megatron.bridge.recipes")
        from megatron.bridge.training.utils import omegaconf_utils
    except Exception as e:  # any import failure means: no usable MB here
        print(f"megatron-bridge import failed: {type(e).__name__}: {e}")
        sys.exit(3)
    return recipes, omegaconf_utils


def note(msg):
    print(f"note: {msg}", file=sys.stderr)


def nano_pretrain(recipes):
    return getattr(recipes, NANO_PRETRAIN)()


def recipe_mode(recipe):
    """The mode a conventional recipe name encodes, as run_recipe.py's infer_recipe_mode."""
    name = f"_{recipe.lower().strip('_')}_"
    if "_pretrain_" in name:
        return "pretrain"
    if "_sft_" in name or "_finetune_" in name:
        return "sft"
    return None


def needs_hub(error):
    """Whether a recipe failed for want of its Hugging Face Hub config (offline, not cached)."""
    text = str(error).lower()
    hints = ("huggingface", "hugging face", "hf_hub", "failed to load configuration")
    return any(hint in text for hint in hints)


def build_config(recipes, recipe, mode):
    """The recipe's ConfigContainer, or the documented stand-in when it needs the Hub."""
    if recipe_mode(recipe) not in (None, mode):
        # run_recipe.py refuses this too
        raise ValueError(f"Mode '{mode}' is incompatible with recipe '{recipe}'")
    builder = getattr(recipes, recipe, None)
    if not callable(builder):
        raise LookupError(f"recipe {recipe!r} is not exported by megatron.bridge.recipes")
    try:
        return builder()
    except Exception as e:
        if not needs_hub(e):
            raise
        reason = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    if mode == "sft":
        from megatron.bridge.recipes.common import _sft_common

        cfg = _sft_common()
        cfg.model = nano_pretrain(recipes).model
        note(f"{recipe}() failed ({reason}); checking _sft_common() with the nano3 pretrain model")
        return cfg
    note(f"{recipe}() failed ({reason}); checking on {NANO_PRETRAIN}()")
    return nano_pretrain(recipes)


def read_overrides(path):
    with open(path, encoding="utf-8") as f:
        words = [line.rstrip("\n") for line in f]
    return [w for w in words if w.strip()]


def check(recipe, mode, overrides_file):
    quiet()
    recipes, omegaconf_utils = import_mb()
    overrides = read_overrides(overrides_file)
    for word in overrides:
        if word[:1] in ("+", "~"):
            raise ValueError(f"{word!r}: `+`/`~` are refused (MB skips an unknown `+key` silently)")
    cfg = build_config(recipes, recipe, mode)
    cfg = omegaconf_utils.process_config_with_overrides(cfg, cli_overrides=overrides)
    # run_recipe.py keeps model.seq_length in step with dataset.seq_length after the overrides.
    seq = getattr(cfg.dataset, "seq_length", None)
    if seq is not None and getattr(cfg.model, "seq_length", None) != seq:
        cfg.model.seq_length = seq
    if mode == "pretrain":
        cfg.dataset.finalize()
    else:
        cfg.dataset.validate()


def flatten(tree, prefix=""):
    """Dotted keys of a nested dict: every key, leaf or not; lists are leaves."""
    keys = []
    for k, v in tree.items():
        key = f"{prefix}{k}"
        keys.append(key)
        if isinstance(v, dict):
            keys.extend(flatten(v, key + "."))
    return keys


def dump_keys():
    quiet()
    recipes, omegaconf_utils = import_mb()
    from omegaconf import OmegaConf

    from megatron.bridge.recipes.common import _sft_common

    def tree(cfg):
        return OmegaConf.to_container(omegaconf_utils.create_omegaconf_dict_config(cfg)[0])

    keys = set(flatten(tree(nano_pretrain(recipes))))
    keys |= {k for k in flatten(tree(_sft_common())) if k == "dataset" or k.startswith("dataset.")}
    versions = ", ".join(
        f"{p} {importlib.metadata.version(p)}"
        for p in ("megatron-bridge", "megatron-core", "omegaconf", "hydra-core", "torch")
    )
    py = ".".join(map(str, sys.version_info[:3]))
    print(f"# Generated by `python mb_config_check.py --dump-keys` (Python {py}; {versions}):")
    print(f"# the key tree of {NANO_PRETRAIN}() plus the dataset.* keys of _sft_common(), sorted.")
    for k in sorted(keys):
        print(k)


def main(argv):
    if argv == ["--dump-keys"]:
        dump_keys()
        return 0
    if len(argv) != 3 or argv[1] not in ("pretrain", "sft"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        check(*argv)
    except Exception as e:
        print(f"error: {type(e).__name__}: {e}")
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
