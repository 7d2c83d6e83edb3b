"""Every float field of the job config refuses inf and nan with a line naming its key. The fields are found by
walking the config models, so a float field added later is covered without touching this file."""

from __future__ import annotations

import typing

import pytest
from pydantic import BaseModel

from tests.conftest import HF_CONFIGS
from trinity.config.loader import load_config
from trinity.config.schema import JobConfig
from trinity.errors import ConfigError

ACTOR = "actor_rollout_ref.actor"


def _args(annotation: typing.Any) -> list[typing.Any]:
    return [a for a in typing.get_args(annotation) if a is not type(None)]


def _holds_float(annotation: typing.Any) -> bool:
    return annotation is float or any(_holds_float(a) for a in _args(annotation))


def _model(annotation: typing.Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model, _args(annotation)) if m is not None), None)


def float_keys(model: type[BaseModel] = JobConfig, prefix: str = "") -> list[tuple[str, bool]]:
    """(dotted key, whether it is a list of floats) of every float field under `model`."""
    out: list[tuple[str, bool]] = []
    for name, info in model.model_fields.items():
        key, annotation = f"{prefix}{name}", info.annotation
        inner = _model(annotation)
        if inner is not None:
            out += float_keys(inner, f"{key}.")
        elif _holds_float(annotation):
            out.append((key, any(typing.get_origin(a) is list for a in [annotation, *_args(annotation)])))
    return out


KEYS = float_keys()


def test_the_walk_finds_the_float_fields():
    found = dict(KEYS)
    for key in (f"{ACTOR}.optim.lr", "critic.optim.lr", f"{ACTOR}.clip_ratio_c", "algorithm.dpo.beta",
                "actor_rollout_ref.rollout.kv_cache_memory_gib", f"{ACTOR}.lora.alpha"):
        assert found.get(key) is False, key
    assert found["data.train_weights"] is True
    assert len(KEYS) >= 30


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
@pytest.mark.parametrize("key,is_list", KEYS, ids=[k for k, _ in KEYS])
def test_non_finite_value_is_refused_naming_its_key(key, is_list, value):
    override = f"{key}=[{value}]" if is_list else f"{key}={value}"
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"model.path={HF_CONFIGS / 'qwen2_5_0_5b'}", override], check_paths=False)
    named = f"{key}.0" if is_list else key
    hits = [p for p in err.value.problems if p.startswith(f"{named}: ")]
    assert hits, err.value.problems
    assert "is not a finite number (<override 2>: " in hits[0] and hits[0].endswith(
        ("write a finite number",) if is_list else ("write a finite number", ")")), hits[0]


def test_the_fix_gives_the_default():
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"model.path={HF_CONFIGS / 'qwen2_5_0_5b'}", f"{ACTOR}.optim.lr=.inf"], check_paths=False)
    assert f"{ACTOR}.optim.lr: inf is not a finite number (<override 2>: {ACTOR}.optim.lr=.inf); write a finite " \
           "number (the default is 1e-05)" in err.value.problems


def test_transformer_config_override_must_be_finite():
    """override_transformer_config passes other TransformerConfig fields through untyped: checked too."""
    key = f"{ACTOR}.megatron.override_transformer_config"
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"model.path={HF_CONFIGS / 'qwen2_5_0_5b'}", f"{key}.hidden_dropout=.nan",
                           f"{key}.attention_dropout=0.1"], check_paths=False)
    assert [p for p in err.value.problems if p.startswith(key)] == [
        f"{key}.hidden_dropout: nan is not a finite number; write a finite number"]
