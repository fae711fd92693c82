"""A stand-in for Megatron-Bridge's `scripts/training/run_recipe.py` in the megatron_* op tests.

The real program is https://github.com/NVIDIA-NeMo/Megatron-Bridge scripts/training/run_recipe.py
at v0.6.0: it builds a recipe's config, applies `key=value` Hydra overrides and trains. This fake
needs no GPU and no Megatron: the tests link it at MB_ROOT/scripts/training/run_recipe.py, and the
op runs it as

    <python> MB_ROOT/scripts/training/run_recipe.py --recipe NAME --mode pretrain|sft KEY=VALUE ...

once per rank (RANK, default 0). Python 3.11, stdlib only.

It checks what the op (ops/src/megatron/) renders, and on the first failure prints
`fake_run_recipe: <what is wrong>` to stderr and exits 2:

1. argv: `--recipe NAME --mode pretrain|sft`, then only `key=value` words; none starts with
   `+`, `~` or `-`, no key twice.
2. every key is in tests/fixtures/megatron-bridge-0.6-keys.txt (dumped from megatron-bridge
   0.6.2), and a `dataset.*` key belongs to the mode's dataset config (pretrain:
   GPTDatasetConfig, sft: GPTSFTDatasetConfig; the two sets below come from the same dump).
3. `checkpoint.save` == `checkpoint.load` == OUT/checkpoint; the cache, TensorBoard and config
   paths lie under OUT/run/; synchronous `torch_dist` saves. Paths are single-quoted Hydra strings.
4. the tokenizer directory: tokenizer.json, and tokenizer_config.json with an `eos_token`.
5. pretrain: `dataset.blend_per_split` (parsed as a Hydra list) names existing .bin/.idx
   prefixes, and matches $FAKE_MB_BLEND (a blend.json) when set; `dataset.split=null`.
   sft: the packed Parquet directories, the `[]` metadata file, the sequence length, and
   `checkpoint.pretrained_checkpoint` (an iter_NNNNNNN directory with train_state.pt).
6. resume: with `checkpoint.ckpt_step=K`, OUT/checkpoint holds a complete iter_K, both trackers
   say K, and nothing newer; without it, OUT/checkpoint holds no iteration and no tracker.
   Only rank 0 checks the directory: the other ranks run beside rank 0, which writes it.

Then rank 0 simulates training: it writes `logger.save_config_filepath` (recipe, mode and the
overrides), creates the TensorBoard and index-cache directories, prints
`iteration i/T | lm loss: X` per iteration, and saves every `checkpoint.save_interval`
iterations and at the last one, in the order MB's synchronous save writes (shards;
iter/train_state.pt = {"step": i}; latest_train_state.pt; latest_checkpointed_iteration.txt;
iter/run_config.yaml), keeping the `checkpoint.most_recent_k` newest iterations. Other ranks
exit 0 after their checks.
`train.exit_interval=E` stops at the first iteration divisible by E, as MB's train loop does
(`step % exit_interval == 0`): on a fresh run that is E.

Knobs (environment):
    FAKE_MB_ARGV_LOG=path   append {"rank", "argv", "ckpt_at_start", "trackers_at_start"} as a
                            JSON line, before any check (ckpt_at_start: the sorted names in
                            OUT/checkpoint, null if it is missing; trackers_at_start: the
                            content of latest_checkpointed_iteration.txt or null)
    FAKE_MB_BLEND=path      the blend.json the pretrain blend must match
    FAKE_MB_FAIL_RANK=r     rank r exits 3 after its checks
    FAKE_MB_DIE_AT=s        at iteration s: shards and tracker written, no train_state.pt or
                            run_config.yaml; print `killed`, exit 137 (a kill mid-save)
    FAKE_MB_SIGTERM_AT=s    at iteration s: save, exit 0 (MB's exit_signal_handler)
    FAKE_MB_SECONDS_PER_ITER=x  sleep x seconds each iteration
    FAKE_MB_FAIL_AT_EXIT=1  save the last iteration as usual, then exit 1 (a crash in teardown)

A real SIGTERM is handled as Megatron-Bridge's train.exit_signal_handler does: the iteration in
progress ends, is saved, and the program exits 0.
"""

import json
import os
import signal
import re
import shutil
import sys
import time
from pathlib import Path

HERE = Path(os.path.realpath(__file__)).parent  # <repo>/tests/py
KEYS_FILE = HERE.parent / "fixtures" / "megatron-bridge-0.6-keys.txt"

# `dataset.*` keys of one mode's dataset config only (megatron-bridge 0.6.2).
PRETRAIN_ONLY = set(
    """add_extra_token_to_sequence allow_ambiguous_pad_tokens blend blend_per_split
    context_parallel_size create_attention_mask data_parallel_size data_path defer_npy_index_mmap
    drop_last_partial_validation_sequence eod_mask_loss fast_cache_load full_validation
    hybrid_context_parallel inter_document_masking mid_level_dataset_surplus mmap_bin_files mock
    multiple_validation_sets num_dataset_builder_threads object_storage_cache_path path_to_cache
    per_dataset_sequences_path random_seed reset_attention_mask reset_position_ids sequence_length
    sequence_parallel_size sequences_per_dataset split split_matrix token_dtype_code
    tokenizer""".split()
)
SFT_ONLY = set(
    """dataset_kwargs dataset_root do_test do_validation enable_offline_packing hf_dataset
    hf_output_root hf_rewrite hf_test_dataset hf_validation_dataset hf_validation_proportion
    max_train_samples memmap_workers offline_packing_specs preprocessing seed""".split()
)

ITER_RE = re.compile(r"^iter_(\d+)$")
TRACKER = "latest_checkpointed_iteration.txt"
LATEST_STATE = "latest_train_state.pt"


class Fail(Exception):
    """A check failed: the message says what is wrong."""


# ---------------------------------------------------------------------------------------------
# argv and override values


def parse_argv(argv):
    """(recipe, mode, {key: raw value}) from `--recipe NAME --mode MODE key=value ...`."""
    if len(argv) < 4 or argv[0] != "--recipe" or argv[2] != "--mode":
        raise Fail(f"argv must start with `--recipe NAME --mode pretrain|sft`, got {argv[:4]}")
    recipe, mode = argv[1], argv[3]
    if not recipe or recipe.startswith("-"):
        raise Fail(f"bad recipe name {recipe!r}")
    if mode not in ("pretrain", "sft"):
        raise Fail(f"--mode must be pretrain or sft, got {mode!r}")
    overrides = {}
    for word in argv[4:]:
        if word[:1] in ("+", "~", "-"):
            raise Fail(f"{word!r}: only plain key=value words may follow --mode")
        key, eq, value = word.partition("=")
        if not eq or not key:
            raise Fail(f"{word!r} is not key=value")
        if key in overrides:
            raise Fail(f"{key} is given twice")
        overrides[key] = value
    return recipe, mode, overrides


def unquote(text):
    """The content of a Hydra single-quoted string."""
    if len(text) < 2 or text[0] != "'" or text[-1] != "'" or "'" in text[1:-1] or "\\" in text:
        raise Fail(f"{text!r} is not a single-quoted Hydra string")
    return text[1:-1]


class Overrides:
    """Typed access to the override values, failing with the key's name."""

    def __init__(self, values):
        self.values = values

    def has(self, key):
        return key in self.values

    def raw(self, key):
        if key not in self.values:
            raise Fail(f"{key} is not given")
        return self.values[key]

    def expect(self, key, want):
        got = self.raw(key)
        if got != want:
            raise Fail(f"{key}={got}, expected {key}={want}")

    def int(self, key):
        try:
            return int(self.raw(key))
        except ValueError:
            raise Fail(f"{key}={self.raw(key)} is not an integer") from None

    def opt_int(self, key):
        """An int, or None when the key is absent or `null`."""
        if not self.has(key) or self.raw(key) == "null":
            return None
        return self.int(key)

    def path(self, key):
        """A single-quoted absolute path."""
        raw = self.raw(key)
        try:
            p = unquote(raw)
        except Fail as e:
            raise Fail(f"{key}: {e}") from None
        if not os.path.isabs(p):
            raise Fail(f"{key}: {p!r} is not absolute")
        return Path(os.path.normpath(p))


# ---------------------------------------------------------------------------------------------
# a small Hydra-list parser: nested [...], '...' strings, numbers, null


NUMBER_RE = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


class HydraList:
    def __init__(self, text):
        self.text, self.pos = text, 0

    def parse(self):
        value = self.value()
        self.space()
        if self.pos != len(self.text):
            raise Fail(f"trailing text at {self.pos}: {self.text[self.pos:self.pos + 20]!r}")
        return value

    def space(self):
        while self.pos < len(self.text) and self.text[self.pos] == " ":
            self.pos += 1

    def value(self):
        self.space()
        rest = self.text[self.pos:]
        if rest.startswith("["):
            return self.list()
        if rest.startswith("'"):
            end = self.text.find("'", self.pos + 1)
            if end < 0:
                raise Fail(f"unterminated string at {self.pos}")
            s = self.text[self.pos + 1 : end]
            if "\\" in s:
                raise Fail(f"backslash in string {s!r}")
            self.pos = end + 1
            return s
        if rest.startswith("null"):
            self.pos += 4
            return None
        m = NUMBER_RE.match(rest)
        if m:
            self.pos += m.end()
            return float(m.group()) if any(c in m.group() for c in ".eE") else int(m.group())
        raise Fail(f"unexpected text at {self.pos}: {rest[:20]!r} (strings must be '...')")

    def list(self):
        self.pos += 1  # '['
        items = []
        self.space()
        if self.text[self.pos : self.pos + 1] == "]":
            self.pos += 1
            return items
        while True:
            items.append(self.value())
            self.space()
            c = self.text[self.pos : self.pos + 1]
            self.pos += 1
            if c == "]":
                return items
            if c != ",":
                raise Fail(f"expected ',' or ']' at {self.pos - 1}")


# ---------------------------------------------------------------------------------------------
# checks


def check_keys(ov, mode):
    try:
        lines = KEYS_FILE.read_text().splitlines()
    except OSError as e:
        raise Fail(f"cannot read the key list: {e}") from None
    keys = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    other_only = SFT_ONLY if mode == "pretrain" else PRETRAIN_ONLY
    for key in ov.values:
        if key not in keys:
            raise Fail(f"{key} is not a Megatron-Bridge 0.6 config key ({KEYS_FILE.name})")
        parts = key.split(".")
        if parts[0] == "dataset" and len(parts) > 1 and parts[1] in other_only:
            raise Fail(f"{key} is not a key of the {mode} dataset config")


def under(path, root):
    return root in path.parents


def check_paths(ov, mode):
    """OUT, the attempt directory, from checkpoint.save; the run/ paths lie inside it."""
    save, load = ov.path("checkpoint.save"), ov.path("checkpoint.load")
    if save != load:
        raise Fail(f"checkpoint.save {save} != checkpoint.load {load}")
    if save.name != "checkpoint":
        raise Fail(f"checkpoint.save {save} does not end in /checkpoint")
    out = save.parent
    run = out / "run"
    run_keys = ["logger.tensorboard_dir", "logger.save_config_filepath"]
    if mode == "pretrain":
        run_keys.append("dataset.path_to_cache")
    for key in run_keys:
        if not under(ov.path(key), run):
            raise Fail(f"{key} {ov.path(key)} is not under {run}")
    ov.expect("checkpoint.async_save", "false")
    ov.expect("checkpoint.ckpt_format", "torch_dist")
    return out


def check_tokenizer(ov):
    ov.expect("tokenizer.tokenizer_type", "HuggingFaceTokenizer")
    d = ov.path("tokenizer.tokenizer_model")
    if not (d / "tokenizer.json").is_file():
        raise Fail(f"tokenizer.tokenizer_model {d} has no tokenizer.json")
    try:
        config = json.loads((d / "tokenizer_config.json").read_text())
    except (OSError, ValueError) as e:
        raise Fail(f"{d}/tokenizer_config.json: {e}") from None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    if not isinstance(eos, str) or not eos:
        raise Fail(f"{d}/tokenizer_config.json has no eos_token string")


def parse_blend(text):
    """[(prefixes, weights) or None] * 3 from dataset.blend_per_split."""
    try:
        value = HydraList(text).parse()
    except Fail as e:
        raise Fail(f"dataset.blend_per_split: {e}") from None
    if not isinstance(value, list) or len(value) != 3:
        raise Fail("dataset.blend_per_split must be a list of 3 (train, valid, test)")
    splits = []
    for name, split in zip(("train", "valid", "test"), value):
        if split is None:
            splits.append(None)
            continue
        ok = (
            isinstance(split, list)
            and len(split) == 2
            and all(isinstance(x, list) for x in split)
            and len(split[0]) == len(split[1]) > 0
            and all(isinstance(p, str) for p in split[0])
            and all(isinstance(w, (int, float)) for w in split[1])
        )
        if not ok:
            raise Fail(f"dataset.blend_per_split {name}: not [[prefix,...],[weight,...]] or null")
        splits.append((split[0], [float(w) for w in split[1]]))
    if splits[0] is None:
        raise Fail("dataset.blend_per_split: the train split is null")
    return splits


def expected_blend(blend_json):
    """The splits a blend.json describes, as parse_blend returns them."""
    blend = json.loads(Path(blend_json).read_text())
    base = os.path.dirname(os.path.abspath(blend_json))
    splits = []
    for name in ("train", "valid", "test"):
        entries = blend.get(name) or []
        if not entries:
            splits.append(None)
            continue
        weights = [float(w) for w in entries[0::2]]
        prefixes = [os.path.abspath(os.path.join(base, rel)) for rel in entries[1::2]]
        splits.append((prefixes, weights))
    return splits


def check_pretrain_data(ov):
    ov.expect("dataset.split", "null")
    splits = parse_blend(ov.raw("dataset.blend_per_split"))
    for split in filter(None, splits):
        for prefix in split[0]:
            if not os.path.isabs(prefix):
                raise Fail(f"blend prefix {prefix!r} is not absolute")
            for ext in (".bin", ".idx"):
                if not os.path.isfile(prefix + ext):
                    raise Fail(f"blend prefix {prefix}: {prefix + ext} does not exist")
    blend_json = os.environ.get("FAKE_MB_BLEND")
    if blend_json:
        want = expected_blend(blend_json)
        for name, got, exp in zip(("train", "valid", "test"), splits, want):
            if got != exp:
                raise Fail(f"dataset.blend_per_split {name} is {got}, {blend_json} says {exp}")


def parquets(d):
    """The *.parquet entries of d, each resolving to a file (symlinks followed)."""
    files = sorted(d.glob("*.parquet"))
    for f in files:
        if not f.is_file():
            raise Fail(f"{f} does not resolve to a file")
    return files


def check_sft_data(ov):
    specs = "dataset.offline_packing_specs"
    train = ov.path(f"{specs}.packed_train_data_path")
    val = ov.path(f"{specs}.packed_val_data_path")
    for d in (train, val):
        if not d.is_dir():
            raise Fail(f"{d} is not a directory")
    if not parquets(train):
        raise Fail(f"{specs}.packed_train_data_path {train} holds no *.parquet")
    validating = ov.has("dataset.do_validation") and ov.raw("dataset.do_validation") == "true"
    if validating and not parquets(val):
        raise Fail(f"dataset.do_validation=true but {val} holds no *.parquet")
    meta = ov.path(f"{specs}.packed_metadata_path")
    try:
        if json.loads(meta.read_text()) != []:
            raise Fail(f"{meta} is not []")
    except (OSError, ValueError) as e:
        raise Fail(f"{specs}.packed_metadata_path: {e}") from None
    if ov.int("dataset.seq_length") != ov.int(f"{specs}.packed_sequence_size"):
        raise Fail(f"dataset.seq_length != {specs}.packed_sequence_size")
    pre = ov.path("checkpoint.pretrained_checkpoint")
    if not re.fullmatch(r"iter_\d{7}", pre.name) or not (pre / "train_state.pt").is_file():
        what = "an iter_NNNNNNN directory holding train_state.pt"
        raise Fail(f"checkpoint.pretrained_checkpoint {pre} is not {what}")


def check_schedule(ov):
    """The numbers the simulated run needs."""
    for key in ("train.train_iters", "checkpoint.save_interval"):
        if ov.int(key) <= 0:
            raise Fail(f"{key} must be positive")
    ov.opt_int("train.exit_interval")
    ov.opt_int("checkpoint.most_recent_k")


def iterations(ckpt):
    """{N: path} of the iter_N directories in ckpt."""
    if not ckpt.is_dir():
        return {}
    found = {}
    for p in ckpt.iterdir():
        m = ITER_RE.match(p.name)
        if m:
            found[int(m.group(1))] = p
    return found


def check_resume_flags(ov):
    """K from checkpoint.ckpt_step (0 without), with the matching exit_on_missing_checkpoint."""
    k = ov.opt_int("checkpoint.ckpt_step")
    ov.expect("checkpoint.exit_on_missing_checkpoint", "true" if k is not None else "false")
    return k


def check_resume_dir(ckpt, k):
    iters = iterations(ckpt)
    trackers = [n for n in (TRACKER, LATEST_STATE) if (ckpt / n).exists()]
    if k is None:
        if iters or trackers:
            names = sorted(p.name for p in iters.values()) + trackers
            raise Fail(f"no checkpoint.ckpt_step, but {ckpt} holds {names}")
        return
    d = ckpt / f"iter_{k:07d}"
    for name in ("train_state.pt", "run_config.yaml", ".metadata", "metadata.json"):
        f = d / name
        if not f.is_file() or (name == "run_config.yaml" and f.stat().st_size == 0):
            raise Fail(f"checkpoint.ckpt_step={k}: {f} is missing or empty")
    tracker = (ckpt / TRACKER).read_text().strip() if (ckpt / TRACKER).is_file() else None
    if tracker != str(k):
        raise Fail(f"checkpoint.ckpt_step={k}: {TRACKER} says {tracker!r}")
    if not (ckpt / LATEST_STATE).is_file():
        raise Fail(f"checkpoint.ckpt_step={k}: {ckpt / LATEST_STATE} is missing")
    newer = sorted(n for n in iters if n > k)
    if newer:
        raise Fail(f"checkpoint.ckpt_step={k}: newer iterations exist: {newer}")


# ---------------------------------------------------------------------------------------------
# simulated training (rank 0)


def write_config(path, recipe, mode, argv):
    """The stand-in for MB's resolved config.yaml: recipe, mode and each override on a line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        "# written by tests/py/fake_run_recipe.py (not Megatron-Bridge)",
        f"recipe: {recipe}",
        f"mode: {mode}",
        "overrides:",
    ] + [f"  - {json.dumps(w)}" for w in argv[4:]]
    path.write_text("\n".join(lines) + "\n")


def save(ckpt, i, argv, complete=True):
    """iter_i/ in the order of MB's synchronous save; complete=False stops after the shards."""
    d = ckpt / f"iter_{i:07d}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "__0_0.distcp").write_bytes(b"\0" * 64)
    (d / ".metadata").write_bytes(b"fake dcp metadata")
    (d / "common.pt").write_bytes(b"fake common state")
    (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    if complete:
        (d / "train_state.pt").write_text(json.dumps({"step": i}))
        shutil.copyfile(d / "train_state.pt", ckpt / LATEST_STATE)
    (ckpt / TRACKER).write_text(str(i))
    if complete:
        (d / "run_config.yaml").write_text(f"argv: {json.dumps(argv)}\n")


def prune(ckpt, keep):
    if keep and keep > 0:
        for n in sorted(iterations(ckpt))[:-keep]:
            shutil.rmtree(ckpt / f"iter_{n:07d}")


def env_int(name):
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def train(ov, out, k, recipe, mode, argv):
    ckpt = out / "checkpoint"
    t = ov.int("train.train_iters")
    s = ov.int("checkpoint.save_interval")
    e = ov.opt_int("train.exit_interval")
    keep = ov.opt_int("checkpoint.most_recent_k")
    die_at, term_at = env_int("FAKE_MB_DIE_AT"), env_int("FAKE_MB_SIGTERM_AT")
    write_config(ov.path("logger.save_config_filepath"), recipe, mode, argv)
    ov.path("logger.tensorboard_dir").mkdir(parents=True, exist_ok=True)
    if mode == "pretrain":  # Megatron's index cache, which the op deletes before publish
        cache = ov.path("dataset.path_to_cache")
        cache.mkdir(parents=True, exist_ok=True)
        (cache / "fake_GPTDataset_indices.npy").write_bytes(b"")
    pace = float(os.environ.get("FAKE_MB_SECONDS_PER_ITER") or 0)
    # Megatron-Bridge's train.exit_signal_handler: SIGTERM saves at the end of the iteration
    # in progress, then exits 0.
    terminated = []
    signal.signal(signal.SIGTERM, lambda *_: terminated.append(True))
    for i in range((k or 0) + 1, t + 1):
        print(f"iteration {i}/{t} | lm loss: {round(10.0 / (i + 1), 6)}", flush=True)
        time.sleep(pace)
        if terminated:
            save(ckpt, i, argv)
            prune(ckpt, keep)
            print(f"exiting program after receiving SIGTERM at iteration {i}", flush=True)
            return 0
        if i == die_at:
            save(ckpt, i, argv, complete=False)
            print("killed", flush=True)
            return 137
        stop = bool(e) and i % e == 0
        if i % s == 0 or i == t or stop or i == term_at:
            save(ckpt, i, argv)
            prune(ckpt, keep)
        if i == term_at:
            print(f"exiting program after receiving SIGTERM at iteration {i}", flush=True)
            return 0
        if stop:
            print(f"exiting program at iteration {i}", flush=True)
            return 0
    if os.environ.get("FAKE_MB_FAIL_AT_EXIT") == "1":
        print("crashed in teardown", flush=True)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------


def log_argv(argv, rank):
    """FAKE_MB_ARGV_LOG: one JSON line per run, written before any check."""
    path = os.environ.get("FAKE_MB_ARGV_LOG")
    if not path:
        return
    save_raw = next((w.split("=", 1)[1] for w in argv if w.startswith("checkpoint.save=")), None)
    listing, tracker = None, None
    if save_raw:
        ckpt = Path(save_raw.strip("'"))
        if ckpt.is_dir():
            listing = sorted(p.name for p in ckpt.iterdir())
        if (ckpt / TRACKER).is_file():
            tracker = (ckpt / TRACKER).read_text()
    line = json.dumps(
        {"rank": rank, "argv": argv, "ckpt_at_start": listing, "trackers_at_start": tracker}
    )
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def main(argv):
    rank = int(os.environ.get("RANK") or 0)
    log_argv(argv, rank)
    try:
        recipe, mode, values = parse_argv(argv)
        ov = Overrides(values)
        check_keys(ov, mode)
        out = check_paths(ov, mode)
        check_tokenizer(ov)
        if mode == "pretrain":
            check_pretrain_data(ov)
        else:
            check_sft_data(ov)
        check_schedule(ov)
        k = check_resume_flags(ov)
        if rank == 0:
            check_resume_dir(out / "checkpoint", k)
    except Fail as e:
        print(f"fake_run_recipe: {e}", file=sys.stderr)
        return 2
    if env_int("FAKE_MB_FAIL_RANK") == rank:
        print(f"fake_run_recipe: rank {rank} fails (FAKE_MB_FAIL_RANK)", file=sys.stderr)
        return 3
    if rank != 0:
        return 0
    return train(ov, out, k, recipe, mode, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
