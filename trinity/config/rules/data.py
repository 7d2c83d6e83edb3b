"""Rules on the files a job reads: training files, tokenizer folder and the checkpoint to resume from."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from trinity.config.schema import JobConfig
from trinity.models.facts import ModelFacts


def _check_tokenizer_files(cfg: JobConfig, problems: list[str]) -> None:
    from trinity.data.loader import missing_tokenizer_files

    key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
    folder = cfg.model.tokenizer_path or cfg.model.path
    if not Path(folder).is_dir():
        return  # reported as a missing folder
    missing = missing_tokenizer_files(folder)
    if missing:
        # Without them transformers loads a tokenizer that encodes every text to nothing, and the
        # job "trains" at loss 0.
        problems.append(
            f"{key}: {folder} has no {missing}; copy them from the original model folder"
            + ("" if cfg.model.tokenizer_path else ", or set model.tokenizer_path to a folder that has them")
        )


def check_vocabulary(cfg: JobConfig, facts: ModelFacts, problems: list[str]) -> None:
    """The tokenizer's ids must fit the model's embedding: an id >= vocab_size indexes past it, which
    megatron-core does not check (garbage on CPU, a device-side assert or silent corruption on GPU)."""
    from trinity.data.loader import missing_tokenizer_files, tokenizer_size

    folder = cfg.model.tokenizer_path or cfg.model.path
    if not Path(folder).is_dir() or missing_tokenizer_files(folder):
        return  # reported as a missing folder or missing files
    size = tokenizer_size(folder)
    if size is not None and size > facts.vocab_size:
        where = "its tokenizer" if not cfg.model.tokenizer_path else f"the tokenizer in {folder} (model.tokenizer_path)"
        problems.append(
            f"model.path: {cfg.model.path} has vocab_size {facts.vocab_size} (config.json), but {where} has "
            f"{size} tokens, so ids {facts.vocab_size}..{size - 1} would index past the embedding; use the "
            "tokenizer the model was made with, or a model whose vocab_size is at least the tokenizer's"
        )


def check_text_file(key: str, path: str, problems: list[str]) -> None:
    """A binary file under a text name (.jsonl, .json, .txt), found from its start before any process."""
    from trinity.data.readers import sniff_text

    problem = sniff_text(Path(path))
    if problem:
        problems.append(f"{key}: {problem}")


def check_data(cfg: JobConfig, problems: list[str], check_paths: bool) -> None:
    from trinity.data.readers import is_hf_dataset_dir

    pt = cfg.spec.data == "text"
    if pt:  # text files and Megatron indexed datasets, with blend weights
        from trinity.data.pretrain import source_problems

        problems += source_problems(cfg.data.train_files, cfg.data.train_weights, check_paths=check_paths)
    elif cfg.data.train_weights is not None:
        problems.append(
            f"data.train_weights: blend weights apply to algorithm.name pt only, not {cfg.spec.name}; "
            "list plain paths in data.train_files"
        )
    if not cfg.data.train_files and not pt:
        problems.append(
            "data.train_files: no training files; list at least one .jsonl, .json or .parquet file or datasets folder"
        )
    for i, f in enumerate([] if pt else cfg.data.train_files):
        if check_paths and is_hf_dataset_dir(Path(f)):
            if importlib.util.find_spec("datasets") is None:
                problems.append(
                    f"data.train_files.{i}: {f} is a Hugging Face datasets folder; reading it needs the datasets "
                    "package: pip install datasets"
                )
        elif check_paths and Path(f).is_dir():
            problems.append(
                f"data.train_files.{i}: {f} is a directory but not a datasets folder (save_to_disk); list the "
                ".jsonl, .json or .parquet files in it (data.train_files takes files, e.g. "
                "[dir/part-0.parquet, dir/part-1.parquet])"
            )
        elif not f.endswith((".jsonl", ".json", ".parquet")) and (check_paths or Path(f).suffix):
            # (without check_paths a name with no suffix may be a datasets folder: not checked)
            problems.append(f"data.train_files.{i}: {f} is not a .jsonl, .json or .parquet file or a datasets folder")
        elif check_paths and not Path(f).is_file():
            problems.append(f"data.train_files.{i}: {f} does not exist")
        elif check_paths and not f.endswith(".parquet"):
            check_text_file(f"data.train_files.{i}", f, problems)
    tok = cfg.model.tokenizer_path
    if tok and check_paths and not Path(tok).is_dir():
        what = "is a file, not a folder" if Path(tok).is_file() else "does not exist"
        problems.append(f"model.tokenizer_path: {tok} {what}; point it at the folder holding tokenizer.json")
    if check_paths:
        _check_tokenizer_files(cfg, problems)
    resume = cfg.trainer.resume
    if resume not in ("auto", "disable") and check_paths and not Path(resume).is_dir():
        problems.append(f"trainer.resume: {resume} is not a checkpoint folder; use auto, disable or an existing folder")
