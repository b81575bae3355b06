"""Property tests (hypothesis) of the config loader and the answer parsers, on arbitrary input."""

import dataclasses
import math
import re
import tempfile
import types
import typing
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from covey.config import GRPOConfig
from covey.errors import ConfigError
from covey.rewards.answers import is_correct, last_number, parse_number, tagged_answer
from covey.rewards import answer_correct, answer_format, symbolic
from covey.data.tasks import gsm8k_final_answer, gsm8k_rows
from covey.data.text import answer_after_reasoning
from covey.trl_fields import TRL_FIELDS

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None)
FIELDS = list(dataclasses.fields(GRPOConfig))
NAMES = [f.name for f in FIELDS]
HINTS = typing.get_type_hints(GRPOConfig)


def declared_type(name: str) -> type:
    """int for 'int', list for 'list[str] | None', dict for 'dict[str, Any] | str | None', ..."""
    hint = HINTS[name]
    base = next(a for a in typing.get_args(hint) if a is not type(None)) if isinstance(hint, types.UnionType) else hint
    return typing.get_origin(base) or base


FIELDS_OF = {kind: [n for n in NAMES if declared_type(n) is kind] for kind in (bool, int, float, str, list)}

# ---- the config loader ----------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
           | st.sampled_from(["true", "no", "none", "null", "1e-5", "8", "-1", "0", "2.5", "nan", "inf", "[1]"]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=2), max_leaves=6)


@st.composite
def plausible_value(draw, field: dataclasses.Field):
    """A value a user might write for ``field``: its default, one of its choices, a neighbour of
    its default, or anything at all."""
    default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    options = [st.just(default), json_values]
    if "choices" in field.metadata:
        options.append(st.sampled_from(field.metadata["choices"]))
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        options.append(st.sampled_from([default * 2, default + 1, -default, str(default)]))
    return draw(st.one_of(options))


@st.composite
def config_dicts(draw):
    """Config mappings: mostly real field names with plausible values, plus junk and TRL keys."""
    values = {}
    for field in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique_by=lambda f: f.name)):
        values[field.name] = draw(plausible_value(field))
    if draw(st.integers(0, 4)) == 0:
        values[draw(st.text(max_size=15) | st.sampled_from(sorted(TRL_FIELDS)) | st.integers())] = draw(json_values)
    return values


def names_the_culprit(message: str, keys, source: str) -> bool:
    """The message names the file (or mapping) or one of the config fields that were set."""
    return source in message or any(k in message for k in keys if isinstance(k, str) and k in NAMES)


def load_dict(values: dict, source: str = "<fuzzed mapping>"):
    """GRPOConfig.from_dict, which may only ever succeed or raise a ConfigError naming the culprit."""
    try:
        return GRPOConfig.from_dict(values, source=source)
    except ConfigError as e:
        assert names_the_culprit(str(e), values, source), (str(e), values)
        return None


def well_typed(cfg: GRPOConfig) -> bool:
    """Every value has its field's type: bools are bools, numbers finite, lists hold strings (numbers
    for reward_weights)."""
    for name in NAMES:
        value, kind = getattr(cfg, name), declared_type(name)
        if value is None:
            continue
        if kind is list:
            if not all(isinstance(v, float if name == "reward_weights" else str) for v in value):
                return False
        elif type(value) is not kind or (kind is float and not math.isfinite(value)):
            return False
    return True


def round_trips(cfg: GRPOConfig) -> bool:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.yaml"
        cfg.save(path)
        return GRPOConfig.from_yaml(path) == cfg


@FUZZ
@given(config_dicts())
def test_any_mapping_gives_a_config_or_a_config_error_and_valid_ones_round_trip(values):
    cfg = load_dict(values)
    if cfg is not None:
        assert well_typed(cfg) and round_trips(cfg)


@FUZZ
@given(st.dictionaries(st.sampled_from(NAMES), json_values, max_size=6))
def test_any_values_for_real_fields_give_a_config_or_a_config_error(values):
    cfg = load_dict(values)
    if cfg is not None:
        assert well_typed(cfg) and round_trips(cfg)


@FUZZ
@given(st.sampled_from(FIELDS_OF[float]),
       st.sampled_from([math.nan, math.inf, -math.inf, "nan", "inf", "-Infinity", 10**400, True, [1.0], {"a": 1.0}]))
def test_a_number_field_rejects_non_finite_and_non_numbers(name, value):
    with pytest.raises(ConfigError, match=re.escape(name)):
        GRPOConfig.from_dict({name: value})


@FUZZ
@given(st.sampled_from(FIELDS_OF[str] + FIELDS_OF[list]), st.sampled_from([True, [["x"]], {"a": "b"}, [None], [{}]]))
def test_a_text_field_rejects_flags_and_containers(name, value):
    assume(not (name == "scale_rewards" and value is True))  # TRL's scale_rewards: true means "group"
    with pytest.raises(ConfigError, match=re.escape(name)):
        GRPOConfig.from_dict({name: value})


yaml_texts = st.one_of(
    st.text(max_size=80),
    st.text(alphabet=st.sampled_from(list("abc_:- \n\t[]{},'\"#&*!|>%@`?01.\x01\x85")), max_size=60),
    config_dicts().map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
)


@st.composite
def mutated_yaml(draw):
    """A YAML text, with some of it replaced by random characters."""
    text = draw(yaml_texts)
    start = draw(st.integers(0, len(text)))
    end = draw(st.integers(start, min(len(text), start + 5)))
    return text[:start] + draw(st.text(max_size=4)) + text[end:]


@FUZZ
@given(mutated_yaml())
def test_any_yaml_text_gives_a_config_or_a_config_error_and_bad_yaml_says_where(text):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            GRPOConfig.from_yaml(path)
        except ConfigError as e:
            message = str(e)
            if "invalid YAML" in message:
                assert str(path) in message and re.search(r"at line \d+, column \d+: ", message), message
            else:
                try:
                    keys = list(yaml.safe_load(text))
                except Exception:  # not a mapping: the message must then name the file
                    keys = []
                assert names_the_culprit(message, keys, str(path)), message


@FUZZ
@given(st.binary(max_size=40))
def test_any_bytes_give_a_config_or_a_config_error(data):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.yaml"
        path.write_bytes(data)
        try:
            GRPOConfig.from_yaml(path)
        except ConfigError as e:
            assert names_the_culprit(str(e), NAMES, str(path))


@FUZZ
@given(config_dicts().filter(bool), st.data())
def test_a_forbidden_character_is_reported_at_its_line_and_column(values, data):
    lines = yaml.safe_dump(values, allow_unicode=True).splitlines()
    line = data.draw(st.integers(0, len(lines) - 1))
    column = data.draw(st.integers(0, len(lines[line])))
    lines[line] = lines[line][:column] + "\x01" + lines[line][column:]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.yaml"
        path.write_text("\n".join(lines))
        with pytest.raises(ConfigError, match=rf"invalid YAML at line {line + 1}, column {column + 1}: "):
            GRPOConfig.from_yaml(path)


@pytest.mark.parametrize("text, where", [
    ("max_steps: [1, 2\n", "line 2, column 1"),
    ("learning_rate: 1e-5\nmax_steps: 3\n\tseed: 1\n", "line 3, column 1"),
    ("run_name: 2024-02-30\n", "line 1, column 11"),
    ("max_steps: !!int ten\n", "line 1, column 12"),
])
def test_invalid_yaml_examples_say_line_and_column(tmp_path, text, where):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"invalid YAML at {where}: "):
        GRPOConfig.from_yaml(path)


def test_nesting_too_deep_for_the_parser_is_a_config_error(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("max_steps: " + "[" * 5000)
    with pytest.raises(ConfigError, match="nested too deeply"):
        GRPOConfig.from_yaml(path)


# ---- the answer parsers ---------------------------------------------------------------------------

answer_texts = st.one_of(
    st.text(),
    st.text(alphabet=st.sampled_from(list("0123456789,.-+$ e\n<>/answerthink٣")), max_size=40),
    st.integers(300, 400).map(lambda n: "9" * n),  # beyond a float's range
)
free_text = st.text(max_size=30)


def chat(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


@FUZZ
@given(answer_texts, answer_texts | json_values)
def test_the_parsers_never_raise_and_stay_in_range(text, answer):
    for value in (parse_number(text), parse_number(answer), last_number(text)):
        assert value is None or (isinstance(value, float) and math.isfinite(value))
    assert tagged_answer(text) is None or tagged_answer(text) in text
    assert answer_after_reasoning(text) in text
    for completion in (text, chat(text)):
        assert is_correct(completion, answer) in (True, False)
        [fmt] = answer_format([completion])
        assert 0.0 <= fmt <= 1.0 and fmt * 4 == int(fmt * 4)
        [score] = answer_correct([completion], [answer])
        # a reference that is not a number: math-verify's verdict where it is installed, else None
        assert score in (0.0, 0.5, 1.0) if parse_number(answer) is not None else (
            score in (None, 0.0, 0.5, 1.0) if symbolic.available() else score is None)


@st.composite
def written_numbers(draw):
    """(value, how a model might write it): integers and decimals, with thousands commas, a dollar
    sign, a trailing full stop."""
    value = Decimal(draw(st.integers(-10**11, 10**11))) / 10 ** draw(st.integers(0, 4))
    text = f"{value:,f}" if draw(st.booleans()) else f"{value:f}"
    if value >= 0 and draw(st.booleans()):
        text = "$" + text
    if draw(st.booleans()):
        text += "."
    return value, text


@FUZZ
@given(written_numbers(), free_text.filter(lambda t: "<answer>" not in t), free_text, st.sampled_from(["", " ", "\n "]))
def test_a_tagged_number_is_correct_against_itself_and_wrong_against_a_neighbour(number, before, after, pad):
    value, written = number
    text = f"{before}<answer>{pad}{written}{pad}</answer>{after}"
    for completion in (text, chat(text)):
        assert is_correct(completion, f"{value:f}") and is_correct(completion, float(value))
        assert not is_correct(completion, f"{value + 1:f}") and not is_correct(completion, float(value - 1))
        assert answer_correct([completion, completion], [f"{value:f}", f"{value + 1:f}"]) == [1.0, 0.0]


@FUZZ
@given(written_numbers(), free_text)
def test_last_number_of_a_text_ending_in_a_number_is_that_number(number, before):
    value, written = number
    assert last_number(f"{before} {written}") == float(value)
    assert parse_number(f" {written} ") == float(value)


@FUZZ
@given(written_numbers(), free_text)
def test_an_untagged_right_number_at_the_end_gets_half_credit(number, before):
    value, written = number
    assume("<answer>" not in before or "</answer>" not in before)
    assert answer_correct([f"{before} {written}"], [f"{value:f}"]) == [0.5]


@FUZZ
@given(free_text.filter(lambda t: "<answer>" not in t), free_text.filter(lambda t: "</answer>" not in t),
       free_text.filter(lambda t: "<answer>" not in t))
def test_tagged_answer_is_the_stripped_content_of_its_only_block(before, inside, after):
    assert tagged_answer(f"{before}<answer>{inside}</answer>{after}") == inside.strip()


@FUZZ
@given(free_text.filter(lambda t: "</think>" not in t), free_text.filter(lambda t: "</think>" not in t))
def test_answer_after_reasoning_follows_its_docstring(reasoning, answer):
    assert answer_after_reasoning(f"<think>{reasoning}</think>{answer}") == answer.strip()
    assert answer_after_reasoning(f"<think>{reasoning}") == ""
    plain = reasoning.replace("<think>", "")
    assert answer_after_reasoning(plain) == plain


@FUZZ
@given(answer_texts, written_numbers())
def test_gsm8k_final_answer_reads_the_number_after_the_last_marker(work, number):
    value, written = number
    assert parse_number(gsm8k_final_answer(f"{work}\n#### {written}")) == float(value)
    try:
        gsm8k_final_answer(work)
    except ValueError:
        assert "####" not in work


@FUZZ
@given(st.lists(st.fixed_dictionaries({"question": json_values, "answer": json_values}), min_size=1, max_size=3))
def test_gsm8k_rows_turn_any_record_into_a_row_or_a_data_error(records):
    from covey.errors import DataError

    try:
        rows = gsm8k_rows(records)
    except DataError as e:
        assert re.search(r"row \d+", str(e))
    else:
        assert [r["answer"] for r in rows] == [gsm8k_final_answer(r["answer"]) for r in records]
