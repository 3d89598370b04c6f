"""jaxpar.rl.rewards: the built-in rewards, a reward module of the user's beside the config, and every
mistake as one sentence."""

import sys

import numpy as np
import pytest

from jaxpar.config.rl import RLConfig
from jaxpar.errors import UserError
from jaxpar.rl.rewards import load_reward, score_all

MODULE = "jaxpar_test_user_reward"
USER_CODE = '''
import numpy as np

def named(prompt, completion, answer, unit="cm"):
    return float(completion == f"{answer} {unit}")

def everything(prompt, completion, **fields):
    return len(fields)

def plain(p, c):
    return np.float32(0.5)

class Checks:
    @staticmethod
    def count(prompt, completion):
        return 3

def boom(prompt, completion):
    raise ValueError("no\\nway")

def nan(prompt, completion):
    return float("nan")

def inf(prompt, completion):
    return np.inf

def yes(prompt, completion):
    return True

def text(prompt, completion):
    return "1.0"

def one_argument(prompt):
    return 1.0

NOT_CALLABLE = 3
'''


def one_sentence(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and message.endswith(".") and message[0].islower(), message
    return message


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A reward module in the current directory (as beside a config), sys.path and sys.modules restored."""
    (tmp_path / f"{MODULE}.py").write_text(USER_CODE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield MODULE
    sys.modules.pop(MODULE, None)


def test_exact_match_compares_the_first_line():
    reward = load_reward(RLConfig(reward="exact_match", answer_field="solution"))
    record = {"solution": 42}
    assert reward.score("q", "42\nbecause six sevens", record) == 1.0
    assert reward.score("q", "  42  ", record) == 1.0
    assert reward.score("q", "43", record) == 0.0
    assert reward.score("q", "", record) == 0.0
    assert reward.score("q", "the answer is 42", record) == 0.0


def test_regex_searches_the_completion():
    reward = load_reward(RLConfig(reward="regex", pattern=r"\\boxed\{\d+\}"))
    assert reward.score("q", r"so \boxed{12}.", {}) == 1.0
    assert reward.score("q", r"\boxed{x}", {}) == 0.0


def test_length_peaks_at_the_target():
    reward = load_reward(RLConfig(reward="length", target_length=10))
    assert [reward.score("q", "x" * n, {}) for n in (10, 5, 15, 20, 25, 0)] == [1.0, 0.5, 0.5, 0.0, 0.0, 0.0]


def test_score_all_gives_float32():
    reward = load_reward(RLConfig(reward="exact_match"))
    scores = score_all(reward, ["a", "b", "c"], ["1", "2", "x"], [{"answer": 1}, {"answer": " 2 "}, {"answer": 3}])
    assert scores.dtype == np.float32
    np.testing.assert_array_equal(scores, [1.0, 1.0, 0.0])
    assert score_all(reward, [], [], []).shape == (0,)


def test_a_user_function_gets_the_fields_it_names(user_module):
    record = {"prompt": "p", "answer": 3, "unit": "mm", "other": 1}
    assert load_reward(RLConfig(reward=f"{user_module}:named")).score("p", "3 mm", record) == 1.0
    assert load_reward(RLConfig(reward=f"{user_module}:named")).score("p", "3 cm", {"answer": 3}) == 1.0
    # **fields takes every field but those the prompt and completion arguments are named after
    assert load_reward(RLConfig(reward=f"{user_module}:everything")).score("p", "c", record) == 3.0
    assert load_reward(RLConfig(reward=f"{user_module}:plain")).score("p", "c", record) == 0.5
    assert load_reward(RLConfig(reward=f"{user_module}:Checks.count")).score("p", "c", record) == 3.0


@pytest.mark.parametrize("cfg, match", [
    (RLConfig(reward="exact-match"), r"^rl.reward='exact-match' is neither a built-in reward \(exact_match, regex, "
                                     r"length\) nor a module:function"),
    (RLConfig(reward="jaxpar_no_such_module:f"), r"the module 'jaxpar_no_such_module' cannot be imported "
                                                  r"\(ModuleNotFoundError: No module named 'jaxpar_no_such_module'\)"),
    (RLConfig(reward="regex"), r"rl.reward=regex needs rl.pattern.*it is empty"),
    (RLConfig(reward="regex", pattern="(a"), r"rl.pattern='\(a' is not a regular expression \(missing \)"),
    (RLConfig(reward="length"), r"rl.reward=length needs rl.target_length.* of at least 1, not 0"),
    (RLConfig(reward="length", target_length=-3), r"not -3"),
])
def test_loading_mistakes(cfg, match):
    with pytest.raises(UserError, match=match) as error:
        load_reward(cfg)
    one_sentence(error)


@pytest.mark.parametrize("name, match", [
    ("missing", r"the module 'jaxpar_test_user_reward' has no 'missing'"),
    ("Checks.missing", r"has no 'Checks.missing'"),
    ("NOT_CALLABLE", r"names an object of type int, not a function"),
    ("one_argument", r"must take the prompt and the completion as its first two arguments"),
])
def test_user_function_mistakes(user_module, name, match):
    with pytest.raises(UserError, match=match) as error:
        load_reward(RLConfig(reward=f"{user_module}:{name}"))
    one_sentence(error)


def test_a_module_that_fails_on_import(tmp_path, monkeypatch):
    (tmp_path / "jaxpar_test_broken_reward.py").write_text("def f(prompt, completion:\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(UserError, match=r"the module 'jaxpar_test_broken_reward' cannot be imported \(SyntaxError"):
        load_reward(RLConfig(reward="jaxpar_test_broken_reward:f"))


LONG_PROMPT = "Compute the sum of the first hundred primes, then explain each step of the work carefully."


@pytest.mark.parametrize("name, match", [
    ("boom", r"rl.reward='jaxpar_test_user_reward:boom' raised an exception \(ValueError: no way\) on the prompt "),
    ("nan", r"returned nan \(float\), not a finite number, on the prompt "),
    ("inf", r"returned inf \(float\), not a finite number"),
    ("yes", r"returned True \(bool\), not a finite number"),
    ("text", r"returned '1.0' \(str\), not a finite number"),
    ("named", r"raised an exception \(TypeError: .*answer"),  # a field its signature names, missing from the record
])
def test_scoring_mistakes_name_the_prompt(user_module, name, match):
    reward = load_reward(RLConfig(reward=f"{user_module}:{name}"))
    with pytest.raises(UserError, match=match) as error:
        reward.score(LONG_PROMPT, "c", {})
    assert repr(LONG_PROMPT[:57] + "...") in one_sentence(error)


def test_exact_match_needs_the_answer_field():
    reward = load_reward(RLConfig(reward="exact_match"))
    with pytest.raises(UserError, match=r"the record of the prompt 'Compute the sum.*\.\.\.' has no field 'answer' "
                                        r"\(rl.answer_field\)") as error:
        score_all(reward, [LONG_PROMPT], ["4"], [{"solution": 4}])
    assert repr(LONG_PROMPT[:57] + "...") in one_sentence(error)
